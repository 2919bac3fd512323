"""boto3's S3 model loaded ahead, in a process that forks the ones that will make S3 clients.

Why: a batch's lease is an S3 object read and written through a boto3 client (:mod:`millpond.lake.lease`); the
first client in a process parses the S3 model and endpoint files, 70-80 ms of every Airflow task on two cores
against 5 ms for the next. Airflow's scheduler (``orchestration.airflow_preload``) calls :func:`warm` before its
executor forks the tasks, which inherit the loaded model in boto3's default session. This module imports nothing
of Millpond's and keeps no state of its own, so the scheduler holds no Millpond code a batch runs.
"""

from __future__ import annotations


def warm() -> bool:
    """Load the S3 model into boto3's default session. The client made for it has placeholder keys and address,
    is never used, has no connection (a client connects on its first request) and starts no thread. False if
    boto3 is missing or fails (a task then loads the model itself)."""
    try:
        import boto3

        boto3.setup_default_session()
        boto3.client("s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:9",
                     aws_access_key_id="unused", aws_secret_access_key="unused")  # noqa: S106 - a placeholder
        return True
    except Exception:  # noqa: BLE001 - the scheduler must start whatever boto3 does
        return False
