"""A discrete-event timeline: tasks that hold resources, with dependencies.

The model, chosen to be simple enough to reason about and fast enough for 1024 GPUs:

* A task has a duration, predecessors, and either a *stream* (a GPU's compute stream) or
  a set of *links* (egress/ingress ports of NVLink or a NIC). It becomes ready when its
  last predecessor finishes; a task with neither stream nor links finishes when ready
  (a join).
* A stream runs one task at a time and is work-conserving: whenever it is idle it starts
  its highest-priority ready task (lowest `priority`, then the order of creation). This
  is how an attention engine with several queues fills a wait for data with other work.
* A transfer crosses links (its sender's egress, its receiver's ingress). Each link is a
  queue that carries one transfer at a time, in the order transfers become ready, and
  never idles while one waits; a transfer is done when every link it crosses has
  carried it. So two equal flows through one NIC take twice as long as one (a NIC shared
  by two senders halves their bandwidth), and an all-to-all takes as long as its busiest
  port, as with fair sharing, except that a first flow finishes earlier instead of all
  finishing together. Links serve a flow independently (its egress and ingress slots
  need not coincide): holding all of them at once would leave ports idle behind a busy
  one, a convoy no real network shows.

`run` returns start and finish times of every task; it uses a heap of finish events,
so it costs O(tasks log tasks).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Timeline:
    num_streams: int
    duration: list = field(default_factory=list)
    stream: list = field(default_factory=list)
    """Stream of each task, or -1 for transfers and joins."""
    links: list = field(default_factory=list)
    priority: list = field(default_factory=list)
    label: list = field(default_factory=list)
    """(kind, rank, name) per task, for traces and breakdowns."""
    successors: list = field(default_factory=list)
    num_preds: list = field(default_factory=list)

    @property
    def num_tasks(self) -> int:
        return len(self.duration)

    def add(self, duration: float, *, stream: int = -1, links: tuple = (), priority: int = 0,
            after=(), label: tuple = ("join", -1, "")) -> int:
        """A new task after the tasks in `after` (None entries are ignored); its id."""
        task = len(self.duration)
        self.duration.append(duration)
        self.stream.append(stream)
        self.links.append(links)
        self.priority.append(priority)
        self.label.append(label)
        self.successors.append([])
        preds = 0
        for p in after:
            if p is not None:
                self.successors[p].append(task)
                preds += 1
        self.num_preds.append(preds)
        return task

    def edge(self, before: int, task: int) -> None:
        """Make `task` wait for `before` too (an order fixed after both were added)."""
        self.successors[before].append(task)
        self.num_preds[task] += 1

    def join(self, after, label: tuple = ("join", -1, "")) -> int | None:
        """A zero-length task after all of `after`; None when there is nothing to wait for."""
        after = [p for p in after if p is not None]
        if not after:
            return None
        if len(after) == 1:
            return after[0]
        return self.add(0.0, after=after, label=label)

    def run(self) -> tuple[list[float], list[float]]:
        """Start and finish time of every task; a transfer's start is when its first link
        began carrying it."""
        n = self.num_tasks
        duration, stream, links, priority, successors = (
            self.duration, self.stream, self.links, self.priority, self.successors)
        start, finish = [0.0] * n, [0.0] * n
        waiting = list(self.num_preds)
        link_free: dict = {}
        ready = [[] for _ in range(self.num_streams)]
        busy = [False] * self.num_streams
        events: list = []  # (finish time, task)
        push, pop = heapq.heappush, heapq.heappop

        def release(tasks, t: float, touched: set) -> None:
            """Make `tasks` ready at t; joins finish at once and release their successors."""
            queue = deque(tasks)  # in order of becoming ready, then of creation
            while queue:
                task = queue.popleft()
                s = stream[task]
                if s >= 0:
                    push(ready[s], (priority[task], task))
                    touched.add(s)
                elif links[task]:
                    end, first = t, None
                    for link in links[task]:
                        begin = link_free.get(link, 0.0)
                        begin = t if t > begin else begin
                        link_free[link] = begin + duration[task]
                        end = max(end, begin + duration[task])
                        first = begin if first is None else first
                    start[task], finish[task] = first, end
                    push(events, (end, task))
                else:
                    start[task] = finish[task] = t
                    for nxt in successors[task]:
                        waiting[nxt] -= 1
                        if waiting[nxt] == 0:
                            queue.append(nxt)

        touched: set = set()
        release([task for task in range(n) if waiting[task] == 0], 0.0, touched)
        t = 0.0
        while True:
            for s in touched:
                if not busy[s] and ready[s]:
                    _, task = pop(ready[s])
                    busy[s] = True
                    start[task], finish[task] = t, t + duration[task]
                    push(events, (finish[task], task))
            if not events:
                break
            touched = set()
            t, task = pop(events)
            while True:
                s = stream[task]
                if s >= 0:
                    busy[s] = False
                    touched.add(s)
                newly = []
                for nxt in successors[task]:
                    waiting[nxt] -= 1
                    if waiting[nxt] == 0:
                        newly.append(nxt)
                if newly:
                    release(newly, t, touched)
                if not events or events[0][0] > t:
                    break
                t, task = pop(events)
        if any(waiting):
            raise RuntimeError("timeline has a dependency cycle")
        return start, finish
