"""``Interruptible``: a task that an urgent request may interrupt, and that resumes with the
whole state it had (a py_trees composite of the flashrt behaviours).

    Interruptible(task, urgent)
        no interrupt pending        -> tick ``task``
        ``interrupt_key`` set       -> halt ``task``; Snapshot (with a lease); tick ``urgent`` to
                                       its end, whatever its outcome; Restore; Drop; clear the key;
                                       tick ``task`` again, from the restored state

The task's progress lives in the served model's state (a policy's route and how far along it
is, an agent's conversation), not in the tree: the restore is what resumes it. The snapshot
carries a lease (``lease_s``), so an interrupt that never resumes (the tree halted during
``urgent``, a restore that fails) leaves no capsule once the lease runs out. An interrupt
that arrives while one is being served is the same one.

FAILURE when the snapshot or the restore fails (the state is then not the task's, and
resuming it would act on another's memory), else whatever ``task`` returns; a drop that fails
after a good restore is left to the lease. An interrupt that fails, or that a halt abandons
while it is served, is over: its key is cleared, so that ticking the Interruptible again does
not serve it a second time. After an abandoned one the state is the urgent branch's until the
tree restores another (``abandoned`` counts them).
"""
from __future__ import annotations

from typing import Any, Iterator

import py_trees
from py_trees.common import Access, Status

from .behaviours import Drop, Restore, Snapshot

INTERRUPT_LEASE_S = 120.0   # longer than an urgent request is expected to take


class Interruptible(py_trees.composites.Composite):
    """``task`` and, when ``interrupt_key`` on the blackboard is true, the urgent request
    served between a snapshot and a restore of the node at ``server`` (see the module)."""

    def __init__(self, name: str, node: Any, task: py_trees.behaviour.Behaviour,
                 urgent: py_trees.behaviour.Behaviour, interrupt_key: str = "interrupt",
                 capsule_key: str | None = None, lease_s: float = INTERRUPT_LEASE_S, server: str = "/flashrt",
                 timeout_s: float = 5.0) -> None:
        capsule_key = capsule_key or f"{name}_capsule"
        calls = {"server": server, "timeout_s": timeout_s}
        self.serve = py_trees.composites.Sequence(f"{name}: serve the interrupt", memory=True, children=[
            Snapshot(f"{name}: snapshot", node, capsule_key, lease_s=lease_s, **calls),
            py_trees.decorators.FailureIsSuccess(f"{name}: urgent (either outcome)", urgent),
            Restore(f"{name}: restore", node, capsule_key, **calls),
            py_trees.decorators.FailureIsSuccess(f"{name}: drop (else its lease)",
                                                 Drop(f"{name}: drop", node, capsule_key, **calls))])
        super().__init__(name, children=[task, self.serve])
        self.task, self.interrupt_key = task, interrupt_key
        self.flag = self.attach_blackboard_client(name=f"{name}: interrupt flag")
        self.flag.register_key(interrupt_key, access=Access.WRITE)
        self.interrupts = 0   # served to the end and resumed
        self.abandoned = 0    # halted while served

    def _pending(self) -> bool:
        return bool(self.flag.get(self.interrupt_key)) if self.flag.exists(self.interrupt_key) else False

    def tick(self) -> Iterator[py_trees.behaviour.Behaviour]:
        if self.status != Status.RUNNING:
            for child in self.children:
                if child.status != Status.INVALID:
                    child.stop(Status.INVALID)
            self.initialise()
        if self.serve.status != Status.RUNNING and self._pending():
            if self.task.status == Status.RUNNING:
                self.task.stop(Status.INVALID)   # halted: a goal in flight is canceled
            self.serve.stop(Status.INVALID)
        if self.serve.status == Status.INVALID and self._pending() or self.serve.status == Status.RUNNING:
            self.current_child = self.serve
            yield from self.serve.tick()
            if self.serve.status == Status.RUNNING:
                self.status = Status.RUNNING
                yield self
                return
            if self.serve.status == Status.FAILURE:
                self.flag.set(self.interrupt_key, False)
                self.stop(Status.FAILURE)
                yield self
                return
            self.flag.set(self.interrupt_key, False)
            self.interrupts += 1
            self.serve.stop(Status.INVALID)
            self.task.stop(Status.INVALID)   # resumed from its start, on the restored state
        self.current_child = self.task
        yield from self.task.tick()
        if self.task.status == Status.RUNNING:
            self.status = Status.RUNNING
        else:
            self.stop(self.task.status)
        yield self

    def stop(self, new_status: Status = Status.INVALID) -> None:
        if new_status == Status.INVALID and self.serve.status == Status.RUNNING:
            self.flag.set(self.interrupt_key, False)
            self.abandoned += 1
        super().stop(new_status)

    # A composite of two fixed children: they are not added or removed after construction.
    def add_child(self, child: py_trees.behaviour.Behaviour) -> Any:
        if len(self.children) >= 2:
            raise TypeError(f"{self.name}: an Interruptible has exactly its task and its urgent request")
        return super().add_child(child)
