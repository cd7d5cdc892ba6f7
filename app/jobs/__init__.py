"""Jobs: computations too large for one request, run as a graph on a Dask cluster.

cluster.py starts the embedded cluster (standard library only, for gunicorn's master);
client.py holds each process's Client; graph.py builds a job's task graph from
app/core/job_tasks.py; store.py keeps job records on the scheduler, so that every
gunicorn worker and every pod sharing the scheduler sees the same jobs.
"""
