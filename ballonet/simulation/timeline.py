"""A discrete-event timeline: tasks that hold resources, with dependencies.

The model, chosen to be simple enough to reason about and fast enough for 1024 GPUs:

* A task has a duration, predecessors, and either a *stream* (a GPU's compute stream) or
  a set of *links* (egress/ingress ports of NVLink or a NIC). It becomes ready when its
  last predecessor finishes; a task with neither stream nor links finishes when ready
  (a join).
* A stream runs one task at a time and is work-conserving: whenever it is idle it starts
  its highest-priority ready task (lowest `priority`, then the order of creation). This
  is how an attention engine with several queues fills a wait for data with other work.
* A transfer crosses links (its sender's egress, its receiver's ingress). A link shares
  its bandwidth equally among the transfers on it (processor sharing): n transfers on a
  link each progress at 1/n of their own speed, so two equal transfers starting
  together both finish at twice the time of one, and a link never idles while one
  waits. A transfer is done when every link it crosses has carried it. So a NIC shared
  by two senders halves their bandwidth, and an all-to-all takes as long as its busiest
  port. Links serve a flow independently (each link shares its own bandwidth; a flow
  slowed on one link does not hand its unused share on another to the others there, as
  max-min fairness would): the same work per link and the same time for a link's last
  transfer, a simpler and faster model than max-min's coupled rates. Each link keeps a
  virtual time that advances at 1/n of real time; a transfer of d seconds that joins at
  virtual time v leaves at virtual time v + d.

`run` returns start and finish times of every task; it uses a heap of finish events and
per link a heap of virtual finish times, so it costs O(tasks log tasks).
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
        """Start and finish time of every task; a transfer starts when it is ready (its
        links share their bandwidth with it from then on)."""
        n = self.num_tasks
        duration, stream, links, priority, successors = (
            self.duration, self.stream, self.links, self.priority, self.successors)
        start, finish = [0.0] * n, [0.0] * n
        waiting = list(self.num_preds)
        left = [0] * n  # per transfer: links still carrying it
        # per link: [transfers on it, virtual time, real time of that virtual time,
        # heap of (virtual finish, task), version of its pending event]
        state: dict = {}
        dirty: set = set()  # links whose next finish changed
        ready = [[] for _ in range(self.num_streams)]
        busy = [False] * self.num_streams
        events: list = []  # (time, 0, task) a kernel ends; (time, 1, link, version) a link's transfer
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
                    start[task] = t
                    left[task] = len(links[task])
                    for link in links[task]:
                        st = state.get(link)
                        if st is None:
                            st = state[link] = [0, 0.0, t, [], 0]
                        elif st[0]:
                            st[1] += (t - st[2]) / st[0]
                        st[2] = t
                        st[0] += 1
                        push(st[3], (st[1] + duration[task], task))
                        dirty.add(link)
                else:
                    start[task] = finish[task] = t
                    for nxt in successors[task]:
                        waiting[nxt] -= 1
                        if waiting[nxt] == 0:
                            queue.append(nxt)

        def reschedule() -> None:
            """The next finish of each changed link, as an event (older ones go stale)."""
            for link in dirty:
                st = state[link]
                st[4] += 1
                if st[0]:
                    push(events, (st[2] + (st[3][0][0] - st[1]) * st[0], 1, link, st[4]))
            dirty.clear()

        touched: set = set()
        release([task for task in range(n) if waiting[task] == 0], 0.0, touched)
        t = 0.0
        while True:
            for s in touched:
                if not busy[s] and ready[s]:
                    _, task = pop(ready[s])
                    busy[s] = True
                    start[task], finish[task] = t, t + duration[task]
                    push(events, (finish[task], 0, task))
            if dirty:
                reschedule()
            if not events:
                break
            touched = set()
            event = pop(events)
            t = event[0]
            while True:
                if event[1] == 0:
                    done = [event[2]]
                    s = stream[done[0]]
                    busy[s] = False
                    touched.add(s)
                else:
                    st = state[event[2]]
                    done = []
                    if event[3] == st[4]:  # not stale: its first transfer is through
                        heap = st[3]
                        tag, task = pop(heap)
                        st[0] -= 1
                        st[1], st[2] = tag, t
                        finished = [task]
                        while heap and heap[0][0] <= tag:
                            finished.append(pop(heap)[1])
                            st[0] -= 1
                        dirty.add(event[2])
                        for task in finished:
                            left[task] -= 1
                            if left[task] == 0:
                                finish[task] = t
                                done.append(task)
                for task in done:
                    newly = []
                    for nxt in successors[task]:
                        waiting[nxt] -= 1
                        if waiting[nxt] == 0:
                            newly.append(nxt)
                    if newly:
                        release(newly, t, touched)
                if dirty:
                    reschedule()
                if not events or events[0][0] > t:
                    break
                event = pop(events)
        if any(waiting):
            raise RuntimeError("timeline has a dependency cycle")
        return start, finish
