"""The CLI's logging (``recsys.logs.configure_logging``): the job's lines at INFO, libraries' chatter left out."""
import subprocess
import sys

_CHILD = """
import logging
from recsys.logs import configure_logging
configure_logging()
logging.getLogger("recsys").info("the job's line")
for name in ("httpx", "urllib3", "py4j"):
    logging.getLogger(name).info("HTTP Request: GET %s", name)
    logging.getLogger(name).warning("a warning from %s", name)
"""


def test_the_job_s_lines_stay_and_http_clients_say_only_what_goes_wrong():
    """``recsys demo`` asks ``recsys serve`` over httpx, which logs every request at INFO: not in the user's output."""
    run = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "INFO recsys: the job's line" in run.stderr
    assert "HTTP Request" not in run.stderr
    assert all(f"WARNING {name}: a warning from {name}" in run.stderr for name in ("httpx", "urllib3", "py4j"))
