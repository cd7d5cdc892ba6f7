"""Where the master listens: the bind address, checked before gunicorn binds it, and the
path of gunicorn's control socket."""
import errno
import os
import socket
import tempfile


class AddressInUse(RuntimeError):
    """gunicorn prints a RuntimeError from on_starting as one line and exits with status 1."""


def taken(addresses, reuse_port: bool = False) -> str | None:
    """The first TCP address of gunicorn's parsed `bind` list that another socket already
    listens on, as host:port; None when all are free. A trial bind with the options
    gunicorn sets itself: gunicorn would retry a taken one for five seconds, then say only
    "Can't connect". Unix sockets and inherited descriptors are left to gunicorn."""
    for address in addresses:
        if not isinstance(address, tuple):
            continue
        host, port = address[:2]
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port and hasattr(socket, "SO_REUSEPORT"):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
                # anything else (an address this machine does not have...) gunicorn reports itself
    return None


def refuse_if_taken(addresses, reuse_port: bool = False, variable: str = "BLOCKGRAD_BIND") -> None:
    if (address := taken(addresses, reuse_port)) is not None:
        raise AddressInUse(f"cannot listen on {address}: the address is already in use "
                           f"(set {variable} to a free host:port)")


def control_socket_path() -> str:
    """One per instance, named by the master's pid, so that instances on one machine never
    share one nor remove another's when they stop; in the user's runtime directory if any."""
    directory = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(directory, f"blockgrad-gunicorn-{os.getpid()}.ctl")
