"""The parallel dimensions of a job: the one place they enter the library.

FSDP shards over the data-parallel dimensions of a ``DeviceMesh`` (one, or two for
HSDP), beside the TP, CP, EP and PP that the caller applied first on other dimensions
of the same mesh. [`ParallelDims`][fsdp_core.parallel_dims.ParallelDims] says which
ranks share what, so that plans, estimates and runtime hooks read one answer instead
of assuming the world is their mesh:

- ``dp_mesh``: what FSDP shards over, the data-parallel shard dimension flattened with
  CP (whose ranks hold other tokens of the same samples) and EP (which borrows
  data-parallel ranks, as torchtitan's does);
- ``batch_mesh``: the ranks that hold different batches, which balancing spreads media
  over (data-parallel and EP);
- ``lockstep_mesh``: every dimension but PP, since TP, CP and EP ranks issue
  collectives inside the forward and hang when their forwards differ;
- ``data_group_ranks``: the TP x CP ranks that hold the same batch; ``sharing_mesh``:
  those that split a trainable tower's items (TP's);
- ``expert_replica_mesh``: the ranks that hold replicas of this rank's expert shard.

A dimension's role comes from its name (``tp``, ``cp``, ``ep``, ``pp`` or their long
forms); a dimension of more than one rank with any other name is refused, because the
library could not tell whether its ranks run the forward together.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_core.internals import torch_modules
from fsdp_core.mesh import REPLICATE_DIM, SHARD_DIM, MeshShape

__all__ = ["DIMENSION_ROLES", "ParallelDims", "dimension_role", "holds_same_batch", "local_shape"]

logger = logging.getLogger(__name__)

#: The roles of non-data-parallel dimensions, each with the mesh dimension names that
#: have it (torchtitan's short names, Lightning's long ones).
DIMENSION_ROLES: Final[dict[str, tuple[str, ...]]] = {
    "tp": ("tp", "tensor_parallel"),
    "cp": ("cp", "context_parallel"),
    "ep": ("ep", "expert_parallel"),
    "pp": ("pp", "pipeline_parallel"),
}


def dimension_role(name: str) -> str | None:
    """The role (``"tp"``, ``"cp"``, ``"ep"``, ``"pp"``) a mesh dimension's name gives
    it, or ``None`` for any other name.

    Args:
        name: a mesh dimension's name.

    Returns:
        Its role, or None.
    """
    return next((role for role, names in DIMENSION_ROLES.items() if name in names), None)


def holds_same_batch(name: str) -> bool:
    """Whether the ranks along the mesh dimension ``name`` hold the same batch (TP, CP).

    Args:
        name: a mesh dimension's name.

    Returns:
        Whether its ranks hold the same batch.
    """
    return dimension_role(name) in ("tp", "cp")


def local_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape of this rank's part of ``tensor``: a DTensor's local shard (TP or EP
    sharded it first; FSDP shards that further), else the tensor's own shape.

    Args:
        tensor: a parameter, plain or a DTensor.

    Returns:
        Its local shape.
    """
    return tensor.to_local().shape if isinstance(tensor, DTensor) else tensor.shape


@dataclass(frozen=True)
class ParallelDims:
    """The dimensions of a job's mesh and which of them are data-parallel.

    ``names`` and ``sizes`` describe every dimension of the mesh the model's ranks
    share (in mesh order); ``dp_names`` are the data-parallel ones FSDP shards over
    (one, or two for HSDP: replicate, then shard). ``mesh`` and ``data_parallel_mesh``
    are the meshes themselves (``None`` for a shape only, e.g. for estimates).

    Raises:
        ValueError: sizes that are not positive, repeated names, data-parallel names
            that are not dimensions (or not one or two, or out of mesh order), or a
            dimension of more than one rank whose name has no known role.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    dp_names: tuple[str, ...]
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    data_parallel_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.names) != len(self.sizes):
            raise ValueError(f"{len(self.names)} dimension names for {len(self.sizes)} sizes")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"mesh dimension names repeat: {self.names}")
        for name, size in self._dims():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"dimension {name!r} has size {size!r}; sizes are positive ints")
        _check_dp_names(self.dp_names, self.names)
        context = [n for n in self.dp_names if dimension_role(n) == "cp" and self.size(n) > 1]
        if context:
            rest = [n for n in self.dp_names if n not in context]
            raise ValueError(
                f"dp_dims names the context-parallel dimension(s) {context}: CP ranks hold the "
                "same batch, and FSDP shards over CP with the data-parallel shard dimension by "
                f"itself; pass dp_dims={rest[0] if len(rest) == 1 else tuple(rest)!r}"
            )
        unknown = [
            f"{name}={size}"
            for name, size in self._dims()
            if name not in self.dp_names and size > 1 and dimension_role(name) is None
        ]
        if unknown:
            known = ", ".join(name for names in DIMENSION_ROLES.values() for name in names)
            raise ValueError(
                f"the mesh has dimensions {', '.join(unknown)} that are neither data-parallel "
                f"({', '.join(self.dp_names)}) nor named for a known role ({known}); "
                "the library cannot tell whether their ranks run the model's forward together "
                "and hold the same batch: name them for their role, or name them data-parallel "
                "with dp_dims=..."
            )

    # ------------------------------------------------------------------ building
    @classmethod
    def from_mesh(
        cls, mesh: DeviceMesh, *, dp_dims: str | Sequence[str] | None = None
    ) -> ParallelDims:
        """The dimensions of ``mesh`` as ``parallelize(model, mesh=..., dp_dims=...)``
        receives it.

        Without ``dp_dims``, ``mesh`` is the data-parallel mesh (1-D, or HSDP 2-D), and
        the mesh it was sliced from (``world_mesh["dp"]``) gives the job's other
        dimensions. With ``dp_dims`` (one or two names), ``mesh`` is the whole mesh.

        Args:
            mesh: the data-parallel mesh, or the whole mesh with ``dp_dims``.
            dp_dims: the data-parallel dimensions of ``mesh``.

        Returns:
            The job's dimensions.

        Raises:
            TypeError: ``mesh`` is not a ``DeviceMesh`` or ``dp_dims`` not names.
            ValueError: ``dp_dims`` names no dimension of ``mesh`` (the message lists
                them), or ``mesh`` without ``dp_dims`` is not a data-parallel mesh (more
                than two dimensions, or a dimension named for TP, CP, EP or PP).
        """
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
        sizes = tuple(int(s) for s in mesh.shape)
        if dp_dims is not None:
            names = tuple(mesh.mesh_dim_names or ())
            if not names:
                raise ValueError(
                    f"dp_dims={dp_dims!r} names dimensions, but the mesh has no dimension "
                    "names: build it with mesh_dim_names=..."
                )
            wanted = _dim_names_arg(dp_dims)
            _check_dp_names(wanted, names)
            return cls(names, sizes, wanted, mesh=mesh, data_parallel_mesh=_slice(mesh, wanted))
        names = _names_of(mesh)
        if mesh.ndim > 2:
            raise ValueError(
                f"a mesh with dimensions {names} is not a data-parallel mesh (FSDP shards over "
                "one dimension, or two for HSDP): pass its data-parallel sub-mesh "
                "(mesh['dp']) or the whole mesh with dp_dims=(<its data-parallel names>)"
            )
        roles = [n for n, s in zip(names, sizes, strict=True) if dimension_role(n) and s > 1]
        if roles:
            raise ValueError(
                f"the mesh's dimensions {roles} are named for tensor, context, expert or "
                f"pipeline parallelism, so {names} is not a data-parallel mesh: pass its "
                f"data-parallel sub-mesh (mesh['dp']) or the whole mesh with dp_dims=..."
            )
        root = torch_modules.root_mesh(mesh)
        root_names = tuple(root.mesh_dim_names or ())
        if root is not mesh and root_names:
            if set(names) <= set(root_names):
                root_sizes = tuple(int(s) for s in root.shape)
                return cls(root_names, root_sizes, names, mesh=root, data_parallel_mesh=mesh)
            # Flattened or unflattened meshes: the root's dimensions are not this mesh's.
            logger.info(
                "the data-parallel mesh %s comes from a mesh with dimensions %s that do not "
                "contain its own; other parallel dimensions are not known (pass the whole "
                "mesh and dp_dims=... to name them)",
                names,
                root_names,
            )
        return cls(names, sizes, names, mesh=mesh, data_parallel_mesh=mesh)

    @classmethod
    def from_sizes(
        cls,
        *,
        dp_replicate: int = 1,
        dp_shard: int,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        pp: int = 1,
    ) -> ParallelDims:
        """A shape without meshes (for plans and estimates), torchtitan's dimension
        order: ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``ep``, ``tp``.

        Args:
            dp_replicate: replicate-group size.
            dp_shard: shard-group size.
            tp: tensor-parallel size.
            cp: context-parallel size.
            ep: expert-parallel size.
            pp: pipeline-parallel size.

        Returns:
            The dimensions, without meshes.

        Raises:
            ValueError: a size is not a positive int.
        """
        named = (
            ("pp", pp),
            (REPLICATE_DIM, dp_replicate),
            (SHARD_DIM, dp_shard),
            ("cp", cp),
            ("ep", ep),
            ("tp", tp),
        )
        for name, size in named:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        kept = tuple((n, s) for n, s in named if s > 1 or n == SHARD_DIM)
        dp = (REPLICATE_DIM, SHARD_DIM) if dp_replicate > 1 else (SHARD_DIM,)
        return cls(tuple(n for n, _ in kept), tuple(s for _, s in kept), dp)

    # ------------------------------------------------------------------- shape
    def _dims(self) -> zip[tuple[str, int]]:
        return zip(self.names, self.sizes, strict=True)

    def size(self, name: str) -> int:
        """The size of the dimension ``name`` (1 when the mesh has none).

        Args:
            name: a dimension's name.

        Returns:
            Its size.
        """
        return self.sizes[self.names.index(name)] if name in self.names else 1

    def role_size(self, role: str) -> int:
        """How many ranks the dimensions of ``role`` (``"tp"``, ...) span together.

        Args:
            role: ``"tp"``, ``"cp"``, ``"ep"`` or ``"pp"``.

        Returns:
            The product of those dimensions' sizes (1 when there is none).

        Raises:
            ValueError: ``role`` is not a role.
        """
        if role not in DIMENSION_ROLES:
            raise ValueError(f"unknown role {role!r}; roles: {', '.join(DIMENSION_ROLES)}")
        return math.prod(self.size(n) for n in self.names if dimension_role(n) == role)

    @property
    def world_size(self) -> int:
        """Ranks of the whole mesh."""
        return math.prod(self.sizes)

    @property
    def dp_shape(self) -> MeshShape:
        """The sizes FSDP shards over (what the estimates cost): the data-parallel ones,
        the shard dimension times CP and EP."""
        sizes = [self.size(n) for n in self.dp_names]
        return MeshShape(
            dp_replicate=sizes[0] if len(sizes) == 2 else 1,
            dp_shard=sizes[-1] * math.prod(self.size(n) for n in self.folded_names),
        )

    @property
    def ep_names(self) -> tuple[str, ...]:
        """The expert-parallel dimensions of more than one rank."""
        return tuple(
            n
            for n, s in self._dims()
            if s > 1 and n not in self.dp_names and dimension_role(n) == "ep"
        )

    @property
    def folded_names(self) -> tuple[str, ...]:
        """The CP and EP dimensions, in mesh order: FSDP shards over them together with
        the data-parallel shard dimension."""
        folded = set(self.cp_names) | set(self.ep_names)
        return tuple(n for n in self.names if n in folded)

    @property
    def expert_replica_names(self) -> tuple[str, ...]:
        """The dimensions an expert shard is replicated over (its gradient sums over them):
        the data-parallel and CP ones."""
        return tuple(n for n in self.names if n in self.dp_names or n in self.cp_names)

    @property
    def expert_replicas(self) -> int:
        """Ranks that hold the same expert shard."""
        return math.prod(self.size(n) for n in self.expert_replica_names)

    @property
    def cp_names(self) -> tuple[str, ...]:
        """The context-parallel dimensions of more than one rank."""
        return tuple(
            n for n in self.data_group_names if dimension_role(n) == "cp" and n not in self.dp_names
        )

    @property
    def other_dims(self) -> dict[str, int]:
        """The dimensions that are not data-parallel, with their sizes."""
        return {n: s for n, s in self._dims() if n not in self.dp_names}

    @property
    def lockstep_names(self) -> tuple[str, ...]:
        """The dimensions whose ranks run the model's forward together: the data-parallel
        ones and those of more than one rank other than PP."""
        return tuple(
            n
            for n, s in self._dims()
            if n in self.dp_names or (s > 1 and dimension_role(n) != "pp")
        )

    @property
    def data_group_names(self) -> tuple[str, ...]:
        """The dimensions of more than one rank whose ranks hold the same batch (TP, CP)."""
        return tuple(n for n, s in self._dims() if s > 1 and holds_same_batch(n))

    @property
    def sharing_names(self) -> tuple[str, ...]:
        """The data-group dimensions whose ranks may split a trainable encoder's items and
        sum its gradients: TP's, whose ranks each get a replicated input's whole gradient
        (none with CP, whose ranks need other items' gradients)."""
        return () if self.cp_names else self.data_group_names

    @property
    def dp_dims(self) -> int:
        """Data-parallel dimensions of more than one rank: each repeats an all-reduce over
        the data-parallel mesh."""
        return sum(1 for size in self.dp_shape.sizes if size > 1)

    @property
    def lockstep_dims(self) -> int:
        """Dimensions of more than one rank among the lockstep ones: each repeats an
        all-reduce over the lockstep mesh."""
        return sum(1 for n in self.lockstep_names if self.size(n) > 1)

    @property
    def is_data_parallel_only(self) -> bool:
        """Whether the lockstep ranks are the data-parallel ranks (no TP, CP, EP)."""
        return self.lockstep_names == self.dp_names

    # ------------------------------------------------------------------ meshes
    @property
    def dp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: the data-parallel mesh (the caller's object when it
        passed that), its shard dimension flattened with CP and EP when the job has them
        (HSDP: ``(replicate, shard_cp)``)."""
        return self._folded(self.folded_names)

    @property
    def batch_mesh(self) -> DeviceMesh:
        """The ranks that hold different batches (what balancing spreads media over): the
        data-parallel mesh, its shard dimension flattened with EP when the job has EP."""
        return self._folded(self.ep_names)

    def _folded(self, extra: tuple[str, ...]) -> DeviceMesh:
        """The data-parallel mesh with ``extra`` flattened into its shard dimension."""
        if not extra:
            return self._need(self.data_parallel_mesh)
        shard = tuple(n for n in self.names if n == self.dp_names[-1] or n in extra)
        kept = self.dp_names[:-1]
        folded = self._need(self.mesh)[(*kept, *shard)]
        return torch_modules.flatten_mesh(folded, "_".join(shard), keep=len(kept))  # type: ignore[no-any-return]

    @property
    def lockstep_mesh(self) -> DeviceMesh:
        """The mesh of the ranks that run this model's forward together (the
        data-parallel mesh itself when there is no other such dimension)."""
        if self.is_data_parallel_only:
            return self.dp_mesh
        return self._sub(self.lockstep_names)

    @property
    def data_group_mesh(self) -> DeviceMesh | None:
        """The mesh of the ranks holding this rank's batch (TP x CP); ``None`` when each
        rank holds its own."""
        return self._sub(self.data_group_names) if self.data_group_names else None

    @property
    def sharing_mesh(self) -> DeviceMesh | None:
        """The mesh of ``sharing_names`` (``None`` when there are none)."""
        return self._sub(self.sharing_names) if self.sharing_names else None

    @property
    def expert_mesh(self) -> DeviceMesh:
        """The mesh the caller shards experts over (its ``ep`` dimensions)."""
        if not self.ep_names:
            raise ValueError(f"these ParallelDims ({self.describe()}) have no ep dimension")
        return self._sub(self.ep_names)

    @property
    def expert_replica_mesh(self) -> DeviceMesh:
        """The ranks that hold this rank's expert shard (``expert_replica_names``)."""
        return self._sub(self.expert_replica_names)

    def lockstep_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's lockstep mesh, sorted (empty without a process group).

        Returns:
            The ranks.
        """
        return _ranks(self.lockstep_mesh) if dist.is_initialized() else ()

    def data_group_ranks(self) -> tuple[int, ...]:
        """Global ranks that hold this rank's batch, sorted (this rank alone without TP or
        CP; empty without a process group).

        Returns:
            The ranks.
        """
        if not dist.is_initialized():
            return ()
        group = self.data_group_mesh
        return (dist.get_rank(),) if group is None else _ranks(group)

    def describe(self) -> str:
        """The dimensions in words, e.g. ``dp_shard=2 (data-parallel), tp=2``.

        Returns:
            The text.
        """
        return ", ".join(
            f"{n}={s}" + (" (data-parallel)" if n in self.dp_names else "") for n, s in self._dims()
        )

    def _sub(self, names: tuple[str, ...]) -> DeviceMesh:
        return _slice(self._need(self.mesh), names)

    def _need(self, mesh: DeviceMesh | None) -> DeviceMesh:
        if mesh is None:
            raise ValueError(
                f"these ParallelDims ({self.describe()}) are a shape without a mesh; build "
                "them with ParallelDims.from_mesh(...) for meshes and ranks"
            )
        return mesh


def _names_of(mesh: DeviceMesh) -> tuple[str, ...]:
    names = tuple(mesh.mesh_dim_names or ())
    if names:
        return names
    return (REPLICATE_DIM, SHARD_DIM) if mesh.ndim == 2 else (SHARD_DIM,) * mesh.ndim


def _dim_names_arg(value: str | Sequence[str]) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"dp_dims must be a dimension name or a tuple of names, got {type(value).__name__} "
            f"({value!r})"
        )
    return tuple(names)


def _check_dp_names(wanted: tuple[str, ...], names: tuple[str, ...]) -> None:
    if not 1 <= len(wanted) <= 2:
        raise ValueError(
            f"dp_dims names {len(wanted)} dimensions {wanted}; FSDP shards over one "
            "data-parallel dimension, or two for HSDP (replicate, shard)"
        )
    missing = [n for n in wanted if n not in names]
    if missing:
        raise ValueError(
            f"dp_dims {missing} are not dimensions of the mesh; its dimensions are {names}"
        )
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"dp_dims repeats a dimension: {wanted}")
    if [names.index(n) for n in wanted] != sorted(names.index(n) for n in wanted):
        raise ValueError(
            f"dp_dims {wanted} are not in the mesh's order {names}: give the replicate "
            "dimension before the shard dimension, as they are in the mesh"
        )


def _slice(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    return mesh if names == tuple(mesh.mesh_dim_names or ()) else mesh[names]


def _ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    return tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
