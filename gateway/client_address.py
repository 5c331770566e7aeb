"""Which address a request comes from, for per-client limits (the gateway's auth lookups, the
console's and admin's login throttles).

The peer of the TCP connection is the client unless it is one of our own reverse proxies
(settings.TRUSTED_PROXIES, env TOLLGATE_TRUSTED_PROXIES, CIDRs, default none). A trusted proxy
appends the address it received the request from to `X-Forwarded-For`, so the client is the
rightmost hop that is not a trusted proxy: everything left of it was written by the client (or
proxies we do not run) and may be forged.

`client_address` is a pure function of its arguments; `request_client_address` reads a Django
request and the setting.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any

from django.conf import settings

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

UNKNOWN = "unknown"  # no peer (a test client, a Unix socket): one shared bucket


def parse_networks(entries: Sequence[str]) -> tuple[IPNetwork, ...]:
    """CIDRs (or single addresses) as networks; ValueError naming the bad entry."""
    networks = []
    for entry in entries:
        text = entry.strip()
        if not text:
            continue
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
        except ValueError:
            raise ValueError(f"not an IP address or CIDR network: {text!r}") from None
    return tuple(networks)


def _parse_address(text: str) -> IPAddress | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:  # [v6]:port
        text = text[1:text.index("]")]
    elif text.count(":") == 1:  # v4:port
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    # An IPv4 client seen through an IPv6 socket is the same client.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _is_trusted(address: IPAddress, trusted: Sequence[IPNetwork]) -> bool:
    return any(address.version == network.version and address in network for network in trusted)


def client_address(peer: str | None, forwarded_for: str | None,
                   trusted: Sequence[IPNetwork]) -> str:
    """The client's address: the peer, or, when the peer is a trusted proxy, the rightmost
    `X-Forwarded-For` hop that is not a trusted proxy. A hop that is not an address (garbage
    written by a client, or `unknown`) ends the walk: the last trusted hop is the client then,
    since no trusted proxy writes such a hop."""
    peer_address = _parse_address(peer) if peer else None
    if peer_address is None:
        return peer.strip() if peer and peer.strip() else UNKNOWN
    if not forwarded_for or not _is_trusted(peer_address, trusted):
        return str(peer_address)
    client = peer_address
    for hop in reversed(forwarded_for.split(",")):
        address = _parse_address(hop)
        if address is None:
            break
        client = address
        if not _is_trusted(address, trusted):
            break
    return str(client)


def rate_limit_key(address: str) -> str:
    """The key a per-client limit counts `address` under: an IPv6 address by its /64 (one
    subscriber's whole allocation, which it may rotate through at will), anything else as is."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address):
        return str(ipaddress.ip_network(f"{parsed}/64", strict=False))
    return address


def request_client_address(request: Any) -> str:
    """The client address of a Django request under settings.TRUSTED_PROXIES."""
    meta = request.META
    return client_address(meta.get("REMOTE_ADDR"), meta.get("HTTP_X_FORWARDED_FOR"),
                          settings.TRUSTED_PROXIES)
