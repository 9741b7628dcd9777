"""One object-store setting (``storage.s3``) for every library that reaches the store.

Three clients touch ``s3://`` paths in a run, and each is configured its own way:

- Spark's S3A (executors and driver): ``spark.hadoop.fs.s3a.*`` settings of the session
  (:func:`spark_settings`, applied by :mod:`recsys.spark.session` to every session recsys starts);
- the driver's pyarrow file systems (locks, manifests, publishing, retention: :mod:`recsys.fs`):
  an :class:`pyarrow.fs.S3FileSystem` built from the same values (:func:`s3_filesystem`);
- boto3, which MLflow uses to download model files from an ``s3://`` artifact store: it reads only
  the environment, so :func:`install` sets ``MLFLOW_S3_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``; and which
  recsys uses for the conditional writes pyarrow cannot send (:mod:`recsys.conditional`), through a client
  built from the same values (:func:`s3_client`).

:func:`install` is called once per process by the entry points (``recsys ...``, the jobs, the
backend) right after the configuration is read: it is the one process-wide setting besides the
workers' caches, because each of these libraries keeps its store settings per process (Hadoop's
``Configuration`` per JVM, boto3 per environment). Credentials never pass through the configuration:
``credentials: default`` is the AWS chain (environment, profile, instance or pod role) in all three.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, MutableMapping
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import pyarrow.fs as pafs

# Hadoop 3.4's S3A takes AWS SDK v2 credential providers (docs/cluster.md lists the jars).
S3A_CREDENTIAL_PROVIDERS = {
    "env": "software.amazon.awssdk.auth.credentials.EnvironmentVariableCredentialsProvider",
    "anonymous": "org.apache.hadoop.fs.s3a.AnonymousAWSCredentialsProvider",
}


@dataclass(frozen=True)
class ObjectStore:
    """``storage.s3`` as the clients need it; ``ObjectStore()`` is AWS with the default chain."""

    endpoint: str | None = None
    region: str | None = None
    path_style: bool = False
    credentials: str = "default"
    s3_as_s3a: bool = False

    @classmethod
    def of(cls, s3: Any) -> "ObjectStore":
        """From ``storage.s3`` (``recsys.config.S3Config``; not imported: the file systems sit below the config)."""
        return cls(s3.endpoint, s3.region, s3.path_style, s3.credentials, s3.s3_as_s3a)

    @property
    def secure(self) -> bool:
        return self.endpoint is None or self.endpoint.startswith("https://")


def spark_settings(store: ObjectStore) -> dict[str, str]:
    """``spark.hadoop.fs.s3a.*`` for the session (static: they must be set before the session starts)."""
    settings: dict[str, str] = {}
    if store.endpoint:
        settings["spark.hadoop.fs.s3a.endpoint"] = store.endpoint
        settings["spark.hadoop.fs.s3a.connection.ssl.enabled"] = str(store.secure).lower()
    if store.region:
        settings["spark.hadoop.fs.s3a.endpoint.region"] = store.region
    if store.path_style:
        settings["spark.hadoop.fs.s3a.path.style.access"] = "true"
    if store.credentials in S3A_CREDENTIAL_PROVIDERS:
        settings["spark.hadoop.fs.s3a.aws.credentials.provider"] = S3A_CREDENTIAL_PROVIDERS[store.credentials]
    if store.s3_as_s3a:
        settings["spark.hadoop.fs.s3.impl"] = "org.apache.hadoop.fs.s3a.S3AFileSystem"
        settings["spark.hadoop.fs.AbstractFileSystem.s3.impl"] = "org.apache.hadoop.fs.s3a.S3A"
    return settings


def s3_filesystem(store: ObjectStore) -> "pafs.S3FileSystem":
    """The driver's pyarrow file system for ``s3://``/``s3a://`` paths under these settings.

    Built explicitly rather than from the URI: ``FileSystem.from_uri`` would look the bucket's region up
    at AWS, which a private endpoint (or a machine without internet) never answers.
    """
    import pyarrow.fs as pafs

    options: dict[str, object] = {"region": store.region or "us-east-1",
                                  "force_virtual_addressing": not store.path_style}
    if store.endpoint:
        parts = urlsplit(store.endpoint)
        options.update(endpoint_override=parts.netloc, scheme=parts.scheme)
    if store.credentials == "anonymous":
        options["anonymous"] = True
    # "default" and "env": the AWS SDK's default chain, whose first source is AWS_ACCESS_KEY_ID/SECRET/SESSION_TOKEN
    return pafs.S3FileSystem(**options)


def s3_client(store: ObjectStore) -> Any:
    """A boto3 S3 client for the same store as :func:`s3_filesystem` (raises ImportError without boto3).

    A session of its own, so that building clients from several threads is safe (boto3's default session
    is not); the client itself is thread-safe. Checksums are sent only where an operation requires them:
    S3-compatible stores that predate S3's default CRC32 checksums refuse requests that carry one.
    """
    import boto3
    import botocore
    from botocore.config import Config as BotoConfig

    options: dict[str, Any] = {
        "s3": {"addressing_style": "path" if store.path_style else "virtual"},
        "retries": {"mode": "standard", "max_attempts": 3},
        "connect_timeout": 10, "read_timeout": 60,
        "request_checksum_calculation": "when_required", "response_checksum_validation": "when_required",
    }
    if store.credentials == "anonymous":
        options["signature_version"] = botocore.UNSIGNED
    try:
        config = BotoConfig(**options)
    except TypeError:   # botocore before 1.36 knows no checksum settings (and sends none by default)
        options.pop("request_checksum_calculation")
        options.pop("response_checksum_validation")
        config = BotoConfig(**options)
    return boto3.session.Session().client("s3", endpoint_url=store.endpoint, region_name=store.region, config=config)


def client_environment(store: ObjectStore) -> dict[str, str]:
    """What boto3 (MLflow's S3 artifact client) reads from the environment for the same store."""
    env: dict[str, str] = {}
    if store.endpoint:
        env["MLFLOW_S3_ENDPOINT_URL"] = store.endpoint
        env["AWS_ENDPOINT_URL_S3"] = store.endpoint
    if store.region:
        env["AWS_DEFAULT_REGION"] = store.region
    return env


_installed = ObjectStore()


def install(store: ObjectStore, environ: MutableMapping[str, str] | None = None) -> ObjectStore:
    """Make ``store`` this process's object store (pyarrow and boto3); returns the previous one.

    Values the environment already holds are kept (an operator's ``MLFLOW_S3_ENDPOINT_URL`` wins).
    """
    global _installed
    env = os.environ if environ is None else environ
    for key, value in client_environment(store).items():
        env.setdefault(key, value)
    previous, _installed = _installed, store
    return previous


def installed() -> ObjectStore:
    """The object store :func:`install` set for this process (AWS defaults until then)."""
    return _installed

