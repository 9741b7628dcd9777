"""Airflow DAG: the nightly job as one BashOperator task per logical date.

Retries are safe: a rerun for the same date replaces that date's partition and no other, and a
date already published with the same model version and configuration is skipped. Exit codes 2
(bad input or configuration) and 3 (validation failed) will not fix themselves on retry.
"""
import pendulum
from airflow import DAG
from airflow.operators.bash import BashOperator

with DAG(
    dag_id="recsys_nightly",
    schedule="15 2 * * *",
    start_date=pendulum.datetime(2024, 5, 1, tz="UTC"),
    catchup=True,            # backfills run oldest first, one date per task
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": pendulum.duration(minutes=10)},
) as dag:
    BashOperator(
        task_id="recommend",
        cwd="/opt/recsys",
        bash_command=(
            "./spark-submit.sh --master {{ var.value.spark_master }} jobs/nightly_recommendations.py "
            "--date {{ ds }} --conf conf/production.yaml"
        ),
        execution_timeout=pendulum.duration(hours=4),
    )
