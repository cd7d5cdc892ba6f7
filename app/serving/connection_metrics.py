"""The worker's connection metrics (app/serving/worker.py), imported after fork so that
prometheus-client's multiprocess mode keeps them in this worker's files; /metrics adds up
every live worker's gauges and every worker's closes."""
from prometheus_client import Counter, Gauge

OPEN = Gauge("blockgrad_connections_open", "Open client connections, summed over live workers.",
             multiprocess_mode="livesum")
IDLE = Gauge("blockgrad_connections_idle", "Kept-alive connections waiting for a byte of their next request.",
             multiprocess_mode="livesum")
AWAITING_HEAD = Gauge("blockgrad_connections_awaiting_head",
                      "Connections whose request head has not fully arrived (new ones included).",
                      multiprocess_mode="livesum")
CLOSED = Counter("blockgrad_connections_closed", "Connections closed, by reason (docs/connections.md).", ["reason"])

