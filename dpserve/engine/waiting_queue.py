"""The scheduler's waiting queue: which waiting request is admitted next.

Scope: the order of the waiting requests under `--scheduling-policy`
(`SchedulerConfig.policy`), and their counts by priority (`SchedulerStats.
waiting_by_priority`). Pure bookkeeping: no blocks, no budget, no clock.

* `priority` (default): the most urgent priority level first (`Request.priority`,
  vLLM's: lower runs first). Within a level, deficit round robin (DRR) between
  tenants (`Request.tenant`; None is one tenant of its own): the tenants with
  waiting requests take turns; each turn a tenant's deficit grows by
  `DRR_QUANTUM` tokens and it is served while its next request's cost fits the
  deficit, which the cost then leaves. A request's cost is what it may take:
  prompt + max_tokens tokens (capped at max_model_len; a pooling request: its
  prompt), charged once, at its first admission. A tenant whose queue empties
  leaves the round and its deficit goes back to 0 (it saves nothing while
  idle); a tenant alone at its level is served without counting. Within a
  tenant: arrival order.
* `fcfs`: one queue in arrival order (priorities and tenants ignored: vLLM's fcfs).

With one tenant and every priority 0 both are today's FCFS.

A preempted request (`push_front`) goes back to the front of its own tenant's
queue at its level, and is not charged again: it keeps its place. The scheduler
peeks the next request, then pops it when admitted (charged) or when setting it
aside (LoRA: not charged, pushed back in front afterwards).

Not here: preemption (the scheduler picks its victims by priority), admission.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from dpserve.engine.request import Request

# Tokens a tenant's deficit grows by per turn. The long-run shares are equal whatever
# its size (turns in which nobody can be served are added up at once, so a small one
# costs nothing); a small one interleaves the tenants finely: with 256, a tenant could
# take 20 requests of 12 tokens in a row, and the shares over 100 steps came out 58/42.
DRR_QUANTUM = 16


class _Level:
    """The waiting requests of one priority: a DRR round over their tenants."""

    def __init__(self) -> None:
        self.queues: dict[str | None, deque[Request]] = {}  # tenant -> its requests
        self.ring: deque[str | None] = deque()  # tenants with requests; ring[0]: its turn
        self.deficit: dict[str | None, int] = {}  # tenant -> tokens it may still take
        self.visiting = False  # ring[0] got its quantum for this turn
        self.size = 0

    def add(self, request: Request, tenant: str | None, front: bool) -> None:
        queue = self.queues.get(tenant)
        if queue is None:
            queue = self.queues[tenant] = deque()
            self.ring.append(tenant)  # a new tenant's first turn ends the round
            self.deficit[tenant] = 0
        if front:
            queue.appendleft(request)
        else:
            queue.append(request)
        self.size += 1

    def peek(self, cost: dict[int, int]) -> Request:
        """The next request by DRR (the round moves on to it; peeking again without
        a pop gives the same one). `cost` maps id(request) to its charge."""
        ring, deficit = self.ring, self.deficit
        if len(ring) == 1:
            return self.queues[ring[0]][0]
        self._skip_empty_rounds(cost)
        while True:
            tenant = ring[0]
            if not self.visiting:
                deficit[tenant] += DRR_QUANTUM
                self.visiting = True
            head = self.queues[tenant][0]
            if cost[id(head)] <= deficit[tenant]:
                return head
            ring.rotate(-1)
            self.visiting = False

    def _skip_empty_rounds(self, cost: dict[int, int]) -> None:
        """Add at once the quanta of whole rounds in which no tenant could be served
        (large requests, a small quantum): the same outcome in O(tenants)."""
        visits = []
        for i, tenant in enumerate(self.ring):
            short = cost[id(self.queues[tenant][0])] - self.deficit[tenant]
            if i == 0 and self.visiting:  # its quantum of this turn is in already
                if short <= 0:
                    return
                visits.append(1 + (short - 1) // DRR_QUANTUM)
            else:
                visits.append(max(1, -(-short // DRR_QUANTUM)))
        rounds = min(visits) - 1
        if rounds > 0:
            for tenant in self.ring:
                self.deficit[tenant] += rounds * DRR_QUANTUM

    def pop(self, request: Request, tenant: str | None, charge: int) -> None:
        queue = self.queues[tenant]
        queue.remove(request)
        self.size -= 1
        if len(self.ring) > 1:
            self.deficit[tenant] -= charge
        if not queue:
            self._drop(tenant)

    def _drop(self, tenant: str | None) -> None:
        """The tenant has nothing waiting: it leaves the round, its deficit goes."""
        del self.queues[tenant], self.deficit[tenant]
        if self.ring[0] == tenant:
            self.ring.popleft()
            self.visiting = False
        else:
            self.ring.remove(tenant)
        if len(self.ring) == 1:  # alone: served without counting from here on
            self.deficit[self.ring[0]] = 0
            self.visiting = False

    def remove_finished(self) -> int:
        removed = 0
        for tenant in list(self.queues):
            queue = self.queues[tenant]
            kept = deque(r for r in queue if not r.is_finished)
            removed += len(queue) - len(kept)
            self.queues[tenant] = kept
            if not kept:
                self._drop(tenant)
        self.size -= removed
        return removed

    def __iter__(self) -> Iterator[Request]:
        for tenant in self.ring:
            yield from self.queues[tenant]


class WaitingQueue:
    """The waiting requests of one scheduler, in the order of its policy (module
    docstring). `fair` is `--scheduling-policy priority`; `max_model_len` caps a
    request's cost."""

    def __init__(self, fair: bool, max_model_len: int) -> None:
        self.fair = fair
        self.max_model_len = max_model_len
        self._levels: dict[int, _Level] = {}
        self._order: list[int] = []  # the levels' priorities, most urgent first
        self._cost: dict[int, int] = {}  # id(request) -> its charge (0: charged before)
        self._size = 0

    def priority(self, request: Request) -> int:
        """The priority the policy gives the request (fcfs: 0 for all)."""
        return request.priority if self.fair else 0

    def _tenant(self, request: Request) -> str | None:
        return request.tenant if self.fair else None

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, level by level (not in admission order)."""
        for p in self._order:
            yield from self._levels[p]

    def add(self, request: Request) -> None:
        """A new request: the back of its tenant's queue."""
        self._put(request, front=False)

    def push_front(self, request: Request) -> None:
        """A preempted (or set aside) request: the front of its tenant's queue."""
        self._put(request, front=True)

    def _put(self, request: Request, front: bool) -> None:
        p = self.priority(request)
        level = self._levels.get(p)
        if level is None:
            level = self._levels[p] = _Level()
            self._order.append(p)
            self._order.sort()
        level.add(request, self._tenant(request), front)
        self._cost[id(request)] = self._charge(request)
        self._size += 1

    def _charge(self, request: Request) -> int:
        if request.num_preemptions or request.scheduled_at is not None:
            return 0  # charged at its first admission
        if request.pooling is not None:
            return request.num_prompt_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            return self.max_model_len
        return min(request.num_prompt_tokens + max_tokens, self.max_model_len)

    def first_priority(self) -> int | None:
        """The most urgent waiting priority (None: nothing waits)."""
        return self._order[0] if self._order else None

    def peek(self) -> Request | None:
        """The request to admit next (None: nothing waits)."""
        if not self._order:
            return None
        return self._levels[self._order[0]].peek(self._cost)

    def pop(self, request: Request, charge: bool = True) -> None:
        """Take out the request `peek` gave: admitted (`charge`: its cost leaves its
        tenant's deficit) or set aside (not charged; `push_front` it back later)."""
        p = self.priority(request)
        level = self._levels[p]
        cost = self._cost.pop(id(request))
        level.pop(request, self._tenant(request), cost if charge else 0)
        self._size -= 1
        if not level.size:
            self._drop_level(p)

    def remove_finished(self) -> None:
        """Drop the requests finished (aborted) while waiting."""
        for p in list(self._order):
            level = self._levels[p]
            for r in level:
                if r.is_finished:
                    self._cost.pop(id(r), None)
            self._size -= level.remove_finished()
            if not level.size:
                self._drop_level(p)

    def _drop_level(self, p: int) -> None:
        del self._levels[p]
        self._order.remove(p)

    def counts_by_priority(self) -> list[list[int]]:
        """[[priority, waiting requests], ...] most urgent first; empty when every
        waiting request has priority 0 (nothing to tell apart)."""
        if self._order == [0] or not self._order:
            return []
        return [[p, self._levels[p].size] for p in self._order]
