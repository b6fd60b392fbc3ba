"""Where a shard's tensor sits in the model's tensor: placements for the common layouts.

A :class:`Placement` says that a registered tensor is the box of a logical tensor of
``global_shape`` that begins at ``offset`` and has the shape ``extent`` (row-major, as a contiguous
torch tensor of that shape holds it). A replica's pieces of one tensor must tile it: no two shards
hold overlapping boxes, unless they hold the very same box (a replicated tensor), and every element
is in some piece. The server checks this at publish and refuses with ``LayoutMismatch`` naming the
tensor and the pieces at fault.

The helpers follow the conventions of the frameworks they are named after, as publicly described:

- Megatron-LM tensor parallelism: a ``ColumnParallelLinear`` weight ``[out, in]`` is split along
  dimension 0 (its outputs), a ``RowParallelLinear`` weight along dimension 1 (its inputs), and
  vocabulary-parallel embeddings along dimension 0; norms and the row-parallel bias are replicated.
- FSDP2 (``Shard(0)``): each rank holds a chunk of dimension 0 as ``torch.chunk`` makes them, so the
  last ranks may hold fewer rows, or none (then there is nothing to register on that rank).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class Placement:
    global_shape: Tuple[int, ...]
    offset: Tuple[int, ...]
    extent: Tuple[int, ...]

    def __post_init__(self) -> None:
        for field in ("global_shape", "offset", "extent"):
            object.__setattr__(self, field, _dims(getattr(self, field)))
        if not (len(self.global_shape) == len(self.offset) == len(self.extent)):
            raise ValueError(f"a placement of {len(self.offset)} offsets and {len(self.extent)} extents "
                             f"for a shape of {len(self.global_shape)} dimensions")
        for dim, (size, at, length) in enumerate(zip(self.global_shape, self.offset, self.extent)):
            if size < 0 or at < 0 or length <= 0 or at + length > size:
                raise ValueError(f"box {self.describe()} does not lie within {list(self.global_shape)} "
                                 f"in dimension {dim}")

    def describe(self) -> str:
        return "[" + ", ".join(f"{at}:{at + length}" for at, length in zip(self.offset, self.extent)) + "]"

    def slice_of(self, full):
        """The piece of a full tensor this placement names (for tests, and for loading a checkpoint)."""
        return full[tuple(slice(at, at + length) for at, length in zip(self.offset, self.extent))]


def _dims(dims: Sequence[int]) -> Tuple[int, ...]:
    """Whole numbers (Python, numpy or torch integers), as a tuple of ints; anything else is a ValueError."""
    try:
        if any(isinstance(d, bool) for d in dims):
            raise TypeError
        return tuple(operator.index(d) for d in dims)
    except TypeError:
        raise ValueError(f"dimensions are whole numbers, not {list(dims)}") from None


_shape = _dims


def whole(global_shape: Sequence[int]) -> Placement:
    """All of the tensor."""
    shape = _shape(global_shape)
    return Placement(shape, (0,) * len(shape), shape)


replicated = whole  # each tensor-parallel rank holds all of it (norms, a row-parallel bias)


def split(global_shape: Sequence[int], dim: int, rank: int, size: int) -> Placement:
    """An even split of dimension ``dim`` into ``size`` pieces; the ``rank``-th. The dimension must
    divide evenly (Megatron pads vocabularies to make it so)."""
    shape = _shape(global_shape)
    if not 0 <= dim < len(shape):
        raise ValueError(f"dimension {dim} of a shape of {len(shape)} dimensions")
    if size <= 0 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} of {size}")
    if shape[dim] % size:
        raise ValueError(f"dimension {dim} of {list(shape)} does not split into {size} equal pieces")
    length = shape[dim] // size
    offset = tuple(rank * length if d == dim else 0 for d in range(len(shape)))
    extent = tuple(length if d == dim else shape[d] for d in range(len(shape)))
    return Placement(shape, offset, extent)


def column_parallel(global_shape: Sequence[int], rank: int, size: int) -> Placement:
    """Megatron ``ColumnParallelLinear`` (q/k/v, gate/up projections; its bias too): rows split."""
    return split(global_shape, 0, rank, size)


def row_parallel(global_shape: Sequence[int], rank: int, size: int) -> Placement:
    """Megatron ``RowParallelLinear`` (attention output, down projection): columns split."""
    return split(global_shape, 1, rank, size)


def vocab_parallel(global_shape: Sequence[int], rank: int, size: int) -> Placement:
    """Megatron ``VocabParallelEmbedding`` and the output layer: the vocabulary (rows) split."""
    return split(global_shape, 0, rank, size)


def dim0_shard(global_shape: Sequence[int], rank: int, size: int) -> Optional[Placement]:
    """FSDP2's ``Shard(0)``: rank ``rank``'s chunk of dimension 0, as ``torch.chunk`` cuts it
    (chunks of ceil(rows / size), the last ones shorter). None if this rank holds no row."""
    shape = _shape(global_shape)
    if not shape:
        raise ValueError("a scalar has no dimension 0 to shard")
    if size <= 0 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} of {size}")
    chunk = -(-shape[0] // size)
    begin = min(rank * chunk, shape[0])
    end = min(begin + chunk, shape[0])
    if begin == end:
        return None
    return Placement(shape, (begin,) + (0,) * (len(shape) - 1), (end - begin,) + shape[1:])
