"""Which peers ``moesaic bench layer --peers`` knows and how to install them (torch-free).

Checked before a run starts, so a typo or a peer that is not installed is refused in one line
naming the install line, without importing torch or the peer.
"""

from __future__ import annotations

import importlib.util

from moesaic.checks import check_one_of
from moesaic.strategies.registry import strategy_names

# The peer -> (the module that must be importable, an install line that keeps the user's torch:
# the extra "peers" holds their torch-free dependencies, the peers go in with --no-deps, since
# their own dependency lists would pull in a torch of pip's choosing and many unused packages).
INSTALL = {
    "torchtitan": (
        "torchtitan",
        "pip install '.[peers]' && pip install --no-deps torchtitan==0.3.0 triton",
    ),
    "deepspeed": (
        "deepspeed",
        "pip install '.[peers]' && DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation "
        "deepspeed==0.19.8",
    ),
}
PEERS = tuple(INSTALL)


def peer_installed(name: str) -> bool:
    """Whether peer ``name``'s package can be imported (without importing it)."""
    check_one_of("peer", name, PEERS)
    return importlib.util.find_spec(INSTALL[name][0]) is not None


def check_names(strategies: tuple[str, ...], peers: tuple[str, ...]) -> None:
    """Refuse unknown strategies, unknown peers and peers that are not installed.

    Raises:
        ValueError: naming the strategy or peer, and for a missing peer its install line.
    """
    for name in strategies:
        check_one_of("strategy", name, strategy_names())
    for name in peers:
        check_one_of("peer", name, PEERS)
        if not peer_installed(name):
            raise ValueError(f"peer {name!r} is not installed; install it with: {INSTALL[name][1]}")
