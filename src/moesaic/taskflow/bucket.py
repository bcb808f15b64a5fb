"""What a taskflow plan is compiled for: a shape bucket and the compile options.

Shape legend: T tokens per rank, H hidden, F expert hidden, E experts (global), e = E / P local
experts, K top-k, P expert-parallel ranks, S slot rows, R = e * P * S receive rows per rank.

A plan is static, routing is not. The plan therefore fixes a *slot layout* (the symmetric layout
of FlashDMoE §5.3 / the padded dispatcher): the receive buffer of every rank holds, for each local
expert j and each source rank s, a slot of S rows at rows ``(j * P + s) * S``; source rank s
writes the tokens it routes to expert j there, in token order, and leaves the rest zero. Every
tile, event and threshold is a function of (T, H, F, E, K, P, S, tile sizes) only; the routing of
a step only decides how many rows of each tile are valid (a tile with no valid rows still fires
its events, so counters stay static). S is the *shape bucket*: dropless routing fits a bucket
when no (source rank, expert) pair routes more than S tokens; ``slot_rows_for`` picks one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from moesaic.checks import check_bool, check_int, check_positive_int
from moesaic.config import ACTIVATIONS, check_top_k

DIRECTIONS = ("forward", "backward")


@dataclass(kw_only=True, slots=True, frozen=True)
class ShapeBucket:
    """Shapes and parallel configuration one plan is compiled for (the paper's "C").

    Attributes:
        tokens: T, tokens per rank.
        hidden: H.
        ffn: F, the expert hidden width.
        experts: E, routed experts over all ranks.
        top_k: K.
        ep_size: P; rank p owns experts ``[p * e, (p + 1) * e)``.
        slot_rows: S, rows per (local expert, source rank) slot; a multiple of ``gmm_tile_m``.
        tile_m: rows of a dispatch tile (communication granularity).
        gmm_tile_m: rows of a GMM / activation / combine tile; a multiple of ``tile_m`` that
            divides ``slot_rows``. None means ``tile_m``.
        activation: "swiglu" (GMM1 computes gate and up) or "gelu".
    """

    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int
    ep_size: int
    slot_rows: int
    tile_m: int = 128
    gmm_tile_m: int | None = None
    activation: str = "swiglu"

    def __post_init__(self) -> None:
        for name in ("tokens", "hidden", "ffn", "experts", "top_k", "ep_size", "slot_rows"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("tile_m", self.tile_m)
        if self.gmm_tile_m is not None:
            check_positive_int("gmm_tile_m", self.gmm_tile_m)
        check_top_k(self.top_k, self.experts, names=("top_k", "experts"))
        if self.experts % self.ep_size:
            raise ValueError(
                f"experts ({self.experts}) must be divisible by the expert-parallel size "
                f"ep_size ({self.ep_size})"
            )
        if self.gmm_rows % self.tile_m:
            raise ValueError(
                f"gmm_tile_m ({self.gmm_rows}) must be a multiple of tile_m ({self.tile_m})"
            )
        if self.slot_rows % self.gmm_rows:
            raise ValueError(
                f"slot_rows ({self.slot_rows}) must be a multiple of gmm_tile_m "
                f"({self.gmm_rows}) so that no tile straddles two slots"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation ({self.activation!r}) must be one of {ACTIVATIONS}")

    @property
    def gmm_rows(self) -> int:
        """Rows of a GMM tile (``gmm_tile_m`` or ``tile_m``)."""
        return self.gmm_tile_m if self.gmm_tile_m is not None else self.tile_m

    @property
    def local_experts(self) -> int:
        """e = E / P."""
        return self.experts // self.ep_size

    @property
    def expert_rows(self) -> int:
        """Rows of one local expert in the receive buffer: P * S."""
        return self.ep_size * self.slot_rows

    @property
    def recv_rows(self) -> int:
        """R = e * P * S rows of the receive buffer of every rank."""
        return self.local_experts * self.expert_rows

    @property
    def return_rows(self) -> int:
        """E * S rows of the combine return buffer (one slot per global expert)."""
        return self.experts * self.slot_rows

    @property
    def act_cols(self) -> int:
        """Width of the GMM1 output: 2F (gate | up) for SwiGLU, F for GELU."""
        return 2 * self.ffn if self.activation == "swiglu" else self.ffn

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(kw_only=True, slots=True, frozen=True)
class CompileOptions:
    """Knobs of the static scheduler.

    Attributes:
        ratr: rank-aware task reordering of communication tiles (paper §4.5, Fig. 6).
        interleave: cache-guided interleaving of the independent backward GMMs by expert.
        unsplit: operator names forced to one task (debugging, and Alg. 1's fall-back: their
            consumers that inherit a partition then fall back to one task too).
        pipeline: re-order each queue by a list schedule with nominal costs (puts first, then
            depth first; ``listsched.py``), so that GMM2 and combine tiles run while GMM1 tiles
            remain instead of after all of them. Applied after RATR and interleaving, whose
            orders break its ties.
    """

    ratr: bool = True
    interleave: bool = True
    unsplit: tuple[str, ...] = ()
    pipeline: bool = False

    def __post_init__(self) -> None:
        check_bool("ratr", self.ratr)
        check_bool("interleave", self.interleave)
        check_bool("pipeline", self.pipeline)
        if not isinstance(self.unsplit, tuple) or not all(isinstance(o, str) for o in self.unsplit):
            raise ValueError(f"unsplit must be a tuple of operator names, got {self.unsplit!r}")

    def to_dict(self) -> dict:
        out = {"ratr": self.ratr, "interleave": self.interleave, "unsplit": list(self.unsplit)}
        if self.pipeline:  # only when set: plans compiled without it keep their fingerprints
            out["pipeline"] = True
        return out


def slot_rows_for(max_count: int, tile_m: int, *, power_of_two_tiles: bool = True) -> int:
    """Smallest bucket S (a multiple of ``tile_m``) that holds ``max_count`` rows.

    With ``power_of_two_tiles`` the number of tiles per slot is rounded up to a power of two, so a
    training run sees a handful of buckets (1, 2, 4, ... tiles) rather than one per step.
    """
    check_int("max_count", max_count, 0)
    check_positive_int("tile_m", tile_m)
    tiles = max(1, math.ceil(max_count / tile_m))
    if power_of_two_tiles:
        tiles = 1 << (tiles - 1).bit_length()
    return tiles * tile_m


def bucket_from_dict(d: object) -> ShapeBucket:
    """Rebuild (and re-validate) a bucket from its ``to_dict`` form."""
    if not isinstance(d, dict):
        raise ValueError(f"bucket must be an object, got {type(d).__name__}")
    known = set(ShapeBucket.__dataclass_fields__)
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"bucket has unknown fields {sorted(unknown)}")
    return ShapeBucket(**d)


def options_from_dict(d: object) -> CompileOptions:
    """Rebuild (and re-validate) compile options from their ``to_dict`` form."""
    if not isinstance(d, dict):
        raise ValueError(f"options must be an object, got {type(d).__name__}")
    unknown = set(d) - {"ratr", "interleave", "unsplit", "pipeline"}
    if unknown:
        raise ValueError(f"options have unknown fields {sorted(unknown)}")
    unsplit = d.get("unsplit", [])
    if not isinstance(unsplit, list):
        raise ValueError(f"options.unsplit must be a list, got {type(unsplit).__name__}")
    return CompileOptions(
        ratr=d.get("ratr", True),
        interleave=d.get("interleave", True),
        unsplit=tuple(unsplit),
        pipeline=d.get("pipeline", False),
    )
