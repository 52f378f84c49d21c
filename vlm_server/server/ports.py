"""Whether a TCP port is taken, asked before gRPC is: gRPC's core prints an error line of its
own (``E0000 ... Failed to add port``) when it cannot bind, so a taken port would give two
lines, one of them in another format, where one that names the flag is wanted."""

from __future__ import annotations

import contextlib
import errno
import socket


def port_in_use(host: str, port: int) -> bool:
    """True when binding ``host:port`` fails because something listens there (port 0, an
    address that does not resolve and other failures are left to the real bind)."""
    if port == 0:
        return False
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        with contextlib.closing(socket.socket(family, kind, proto)) as probe:
            # As the real server binds: address reuse on (a port left in TIME_WAIT is free),
            # port sharing off (a listener is a conflict).
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return True
    return False
