"""moto's S3 server, answering one request at a time: run as ``python moto_serial.py HOST PORT``.

S3 settles racing conditional writes atomically: of several ``PutObject`` with ``If-None-Match: *`` on one
absent key exactly one succeeds. moto's threaded server checks the precondition and then writes, in two
steps with other requests' threads in between, so two racing creates can both succeed (the date-lock race
test saw two holders of one lock on a loaded CI machine). Serving requests one at a time gives moto S3's
contract back, so the tests exercise the job's compare-and-set, not the emulator's race. Each connection keeps
its thread; moto's handling of a request (its body read included) runs one at a time.
"""
import sys
import threading

from werkzeug.serving import run_simple

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app


def main(host: str, port: int) -> None:
    app = DomainDispatcherApplication(create_backend_app)
    one_at_a_time = threading.Lock()

    def serial(environ, start_response):
        with one_at_a_time:
            return list(app(environ, start_response))   # the whole answer, built under the lock

    run_simple(host, port, serial, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
