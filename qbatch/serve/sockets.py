"""Who owns the other end of a loopback TCP connection: the Unix user behind a request (runs.check_client).

Linux names a socket's owner in two places. Its sock_diag netlink interface looks one socket up by its
addresses and ports and answers with that socket alone (`ss` uses it); /proc/net/tcp lists every socket,
and reading it walks the whole TCP table (milliseconds a read, on every request, on the event loop: with
64 clients it held each request for a few hundred of them, docs/benchmarks.md#h100-64). So the netlink
lookup comes first, /proc/net/tcp where netlink is not there to ask.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from pathlib import Path

PROC_TCP = ("/proc/net/tcp", "/proc/net/tcp6")  # Linux's TCP sockets: local and remote address, owner's uid

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
NO_COOKIE = 0xFFFFFFFF  # INET_DIAG_NOCOOKIE: look the socket up by its addresses alone
ALL_STATES = 0xFFFFFFFF
HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
UID_AT = HEADER.size + 4 + 48 + 12  # inet_diag_msg: 4 bytes, the socket id (48), expires/rqueue/wqueue, then uid


class Unavailable(Exception):
    """The system has no sock_diag to ask (not Linux, or netlink refused): read /proc instead."""


def owner(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The uid that owns the socket from `client` (address, port) to `server` on this host; None where the
    system does not say or the socket is gone."""
    try:
        return netlink_owner(client, server)
    except Unavailable:
        return proc_owner(client[1], server[1], PROC_TCP)


def netlink_owner(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """sock_diag's exact lookup of the client's socket (local: client, remote: server). A client that an IPv6
    socket shows as IPv4-mapped (::ffff:127.0.0.1) may hold an IPv4 socket or an IPv6 one: both are asked."""
    try:
        local, remote = ipaddress.ip_address(client[0]), ipaddress.ip_address(server[0])
    except ValueError:
        return None
    pairs = [(local, remote)]
    if isinstance(local, ipaddress.IPv6Address) and local.ipv4_mapped:
        mapped = remote.ipv4_mapped if isinstance(remote, ipaddress.IPv6Address) else remote
        if mapped is not None:
            pairs.insert(0, (local.ipv4_mapped, mapped))
    for local, remote in pairs:
        if local.version == remote.version:
            uid = _ask(local, client[1], remote, server[1])
            if uid is not None:
                return uid
    return None


def _ask(local: IPAddress, local_port: int, remote: IPAddress, remote_port: int) -> int | None:
    family = socket.AF_INET if local.version == 4 else socket.AF_INET6
    request = (struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, ALL_STATES)
               + struct.pack("!HH", local_port, remote_port) + local.packed.ljust(16, b"\0")
               + remote.packed.ljust(16, b"\0") + struct.pack("=III", 0, NO_COOKIE, NO_COOKIE))
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as sock:
            sock.settimeout(1.0)
            sock.send(HEADER.pack(HEADER.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + request)
            answer = sock.recv(8192)
    except (AttributeError, OSError) as exc:  # no AF_NETLINK (not Linux), no sock_diag, or no answer
        raise Unavailable(str(exc)) from exc
    if len(answer) < HEADER.size + 4:
        raise Unavailable("a short netlink answer")
    kind = HEADER.unpack_from(answer)[1]
    if kind == NLMSG_ERROR:
        code = -struct.unpack_from("=i", answer, HEADER.size)[0]
        if code == errno.ENOENT:
            return None  # no such socket
        raise Unavailable(os.strerror(code))
    if kind != SOCK_DIAG_BY_FAMILY or len(answer) < UID_AT + 4:
        raise Unavailable(f"an unexpected netlink answer (type {kind})")
    return int(struct.unpack_from("=I", answer, UID_AT)[0])


def proc_owner(local_port: int, remote_port: int, tables: tuple[str, ...]) -> int | None:
    """The uid /proc/net/tcp{,6} gives the socket from `local_port` to `remote_port`; None where none is listed."""
    for table in tables:
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
            if len(fields) > 7 and _port(fields[1]) == local_port and _port(fields[2]) == remote_port:
                return int(fields[7])
    return None


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1], 16)
