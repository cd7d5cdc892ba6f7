"""Jobs: computations too large for one request, kept in a database and run as a graph on a
Dask cluster.

db.py is the job store, the source of truth (records, inputs, results); store.py is the
web workers' side of it (they never talk to Dask); runner.py, one process per service,
claims jobs, submits each one's graph (graph.py, from app/core/job_tasks.py) and stores its
result; cluster.py and supervisor.py start and keep up the runner and the embedded cluster
(standard library only, for gunicorn's master).
"""
