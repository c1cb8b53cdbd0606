"""ZeRO-Offload: the optimizer state (and the float32 master parameters) kept in host memory.

Between steps the offloaded arrays live in the host memory kind `pinned_host`, sharded exactly
as on the device (the ZeRO stage decides their layout; each device's host holds its shard).
Inside the step they are brought to the device where they are used: the parameters before the
gradients, the optimizer state only once the gradients exist (an optimization barrier orders
the transfer after the backward pass, so the moments never share device memory with the
activations), and the updated arrays go back to the host. XLA emits the transfers as
asynchronous copies the scheduler overlaps with compute; on the GPU they cross PCIe.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import NamedSharding

from longt5_jax.errors import UsageError
from longt5_jax.parallel.mesh import OFFLOADS, Offload, compile_only

__all__ = ["OFFLOADS", "NoHostMemory", "StateMemory", "check_host_memory", "in_memory"]
HOST = "pinned_host"


class NoHostMemory(UsageError):
    """The devices cannot hold arrays in host memory."""


def check_host_memory(device: Any) -> None:
    """A one-line error where `device`'s backend has no host memory kind to offload to."""
    if compile_only(device):
        return  # a program for it is still compiled with host memory (see `in_memory`)
    kinds = {m.kind for m in device.addressable_memories()}
    if HOST not in kinds:
        raise NoHostMemory(
            f"ParallelConfig.offload: the {device.platform} devices have no '{HOST}' memory "
            f"(they have {sorted(kinds) or 'none'}); use ParallelConfig.offload='none'"
        )


def in_memory(sharding: NamedSharding, kind: str) -> NamedSharding:
    """`sharding` in memory `kind`. Compile-only devices report no memories, and a sharding
    over them would drop the kind, so there it is stated over the abstract mesh: the program
    compiled for the target then carries it as a real run's would."""
    placed = sharding.with_memory_kind(kind)
    if placed.memory_kind == kind:
        return placed
    return NamedSharding(sharding.mesh.abstract_mesh, sharding.spec, memory_kind=kind)


@dataclasses.dataclass(frozen=True)
class StateMemory:
    """Where the train state lives between steps, and the moves a step makes.

    `params` and `opt_state` are the shardings on the device; `offload` says which of them are
    kept in host memory instead."""

    params: Any
    opt_state: Any
    offload: Offload = "none"

    @property
    def params_offloaded(self) -> bool:
        return self.offload == "optimizer_and_params"

    @property
    def opt_offloaded(self) -> bool:
        return self.offload != "none"

    @staticmethod
    def _in(shardings: Any, kind: str) -> Any:
        return jax.tree.map(lambda s: in_memory(s, kind), shardings)

    @property
    def params_home(self) -> Any:
        """The parameters' shardings between steps."""
        return self._in(self.params, HOST) if self.params_offloaded else self.params

    @property
    def opt_home(self) -> Any:
        """The optimizer state's shardings between steps."""
        return self._in(self.opt_state, HOST) if self.opt_offloaded else self.opt_state

    def params_in(self, params: Any) -> Any:
        """The parameters on the device, for the gradients and the update."""
        if not self.params_offloaded:
            return params
        return jax.device_put(params, self._in(self.params, "device"))

    def opt_in(self, opt_state: Any, after: Any) -> tuple[Any, Any]:
        """The optimizer state on the device, moved once `after` (the gradients) is computed;
        returns both."""
        if not self.opt_offloaded:
            return opt_state, after
        after, opt_state = jax.lax.optimization_barrier((after, opt_state))
        return jax.device_put(opt_state, self._in(self.opt_state, "device")), after

    def params_out(self, params: Any) -> Any:
        """Updated parameters back where they live between steps."""
        return jax.device_put(params, self.params_home) if self.params_offloaded else params

    def opt_out(self, opt_state: Any) -> Any:
        return jax.device_put(opt_state, self.opt_home) if self.opt_offloaded else opt_state
