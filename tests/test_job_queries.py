"""The job routes' cost does not grow with the jobs kept (issue 30): the statements a web worker
sends for a POST /v1/jobs, a GET of a job and a /metrics scrape, counted in PostgreSQL's own log
(log_statement = all, each line tagged with the client's application_name), on a server
started as `make serve` starts it, with 30 and then 10,000 finished jobs in its store."""
import re
import uuid

import numpy as np
import psycopg
import pytest
import requests
import sqlalchemy as sa

from tests.postgres import new_database
from tools.job_rows import add_finished_jobs
from tools.server import gunicorn_server, wait_until

pytestmark = pytest.mark.slow
WAIT_S = 90
# One log line per statement, after a prefix naming its client: "<application>|<database>|LOG:  ..."
PREFIX = "%a|%d|"
STATEMENT = re.compile(r"^(?P<app>[^|]*)\|(?P<db>[^|]*)\|LOG:  (statement|execute [^:]*): (?P<sql>.*)$")


def server_setting(admin_uri: str, **settings: str | None) -> None:
    """ALTER SYSTEM (None: RESET) and a reload: every open session takes them at its next statement."""
    with psycopg.connect(admin_uri, autocommit=True) as admin:
        for name, value in settings.items():
            admin.execute(f"ALTER SYSTEM RESET {name}" if value is None else f"ALTER SYSTEM SET {name} = '{value}'")
        admin.execute("SELECT pg_reload_conf()")


@pytest.fixture(scope="module")
def logged(postgres_server):
    """A database of its own, every statement sent to it logged in the server's log file."""
    with new_database(postgres_server, "queries") as url:
        server_setting(postgres_server.get_uri(), log_statement="all", log_line_prefix=PREFIX)
        try:
            yield url, postgres_server.log
        finally:
            server_setting(postgres_server.get_uri(), log_statement=None, log_line_prefix=None)


def web_statements(log, url: str, action) -> list[str]:
    """The statements the service's web workers sent to `database` while `action` ran. A
    backend writes each line before it runs the statement, so all of them are in the file once
    the answer is back; a marker statement sent after it bounds the read."""
    start = log.stat().st_size
    action()
    marker = f"marker-{uuid.uuid4().hex}"
    with psycopg.connect(url) as conn:
        conn.execute(f"SELECT '{marker}'")
    assert wait_until(lambda: marker in read_from(log, start), WAIT_S, 0.05), "the marker statement is logged"
    found = []
    for line in read_from(log, start).split(marker)[0].splitlines():
        match = STATEMENT.match(line)
        if match and match["app"] == "blockgrad-web" and match["db"] == sa.make_url(url).database:
            found.append(match["sql"])
    return found


def read_from(log, offset: int) -> str:
    with open(log, "rb") as file:
        file.seek(offset)
        return file.read().decode(errors="replace")


def test_a_post_a_get_and_a_scrape_send_the_same_statements_at_30_and_10000_kept_jobs(logged):
    url, log = logged
    env = {"BLOCKGRAD_JOBS_DB": url, "BLOCKGRAD_DASK_SCHEDULER": "", "BLOCKGRAD_DASK_WORKERS": "1",
           "BLOCKGRAD_MAX_JOB_RECORDS": "20000"}
    with gunicorn_server(workers=1, env=env) as server:
        body = {"vectors": np.ones((4, 2)).tolist(), "factor": 2, "outputs": ["losses"]}

        def post():
            answer = requests.post(f"{server.url}/v1/jobs", json=body, timeout=WAIT_S)
            assert answer.status_code == 202, answer.text
            seen["job"] = answer.json()["id"]

        def get():
            assert requests.get(f"{server.url}/v1/jobs/{seen['job']}", timeout=WAIT_S).status_code == 200

        def scrape():
            assert "blockgrad_jobs" in requests.get(f"{server.url}/metrics", timeout=WAIT_S).text

        seen, counts = {}, {}
        for kept in (30, 10_000):
            add_finished_jobs(url, kept - (30 if kept > 30 else 0))  # kept: the TTL is an hour
            for action in (post, get, scrape):
                action()  # the pool's connections are open, nothing is read for the first time
            counts[kept] = {action.__name__: web_statements(log, url, action) for action in (post, get, scrape)}
    for route, sent in counts[30].items():
        web = [line for line in log.read_text().splitlines() if "blockgrad-web" in line]
        assert sent, f"no statement of the {route} was seen in the log: the count proves nothing ({web[-20:]})"
        assert [normal(s) for s in sent] == [normal(s) for s in counts[10_000][route]], (route, counts)


def normal(sql: str) -> str:
    """A statement without its literals (ids differ from request to request)."""
    return re.sub(r"'[^']*'|\$\d+|\b\d+\b", "?", sql)
