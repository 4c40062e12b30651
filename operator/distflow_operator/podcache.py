"""The operator's view of its node pods: watch events, corrected by periodic LISTs.

kopf indices are only ever updated by watch events. When a watch ends with
410 Gone (or the API server restarts with its history compacted), kopf lists
again but never removes objects that vanished in the gap, so a deleted pod
would stay "Running" in an index forever and a gang restart would wait for
it. This cache is fed by the same watch events and, every resync, replaced by
a LIST with the label selector of distflow's pods, as a client-go reflector
replaces its store.

Entries written by an event after a LIST was started are newer than that
LIST's answer, so a relist never overwrites or drops them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from distflow_operator.observed import PodView, pod_view
from distflow_operator.render import LABEL_JOB

JobKey = tuple[str, str]
"""(namespace, job name)"""
MAX_DISRUPTED_PODS = 64


class PodCache(Mapping[JobKey, list[PodView]]):
    """(namespace, job name) -> the job's node pods, as last observed."""

    def __init__(self) -> None:
        self._seq = itertools.count(1)
        self._written: dict[str, tuple[JobKey, int]] = {}
        """pod uid -> (job key, sequence number of the last write)."""
        self._by_job: dict[JobKey, dict[str, PodView]] = {}
        self._disrupted: dict[JobKey, dict[str, tuple[str | None, int | None]]] = {}
        """uid -> (owner uid, attempt) of pods deleted after a disruption (eviction, preemption), oldest first.
        Keyed by uid: pod names repeat in every attempt and in a re-created job of the same name."""

    @staticmethod
    def _identify(pod: Mapping[str, Any]) -> tuple[str, JobKey] | None:
        meta = pod.get("metadata") or {}
        job = (meta.get("labels") or {}).get(LABEL_JOB)
        return (meta["uid"], (meta.get("namespace", ""), job)) if job and meta.get("uid") else None

    def _put(self, uid: str, key: JobKey, view: PodView) -> None:
        self._written[uid] = (key, next(self._seq))
        self._by_job.setdefault(key, {})[uid] = view

    def forget(self, uid: str) -> JobKey | None:
        """Drop one pod (deleted, or a DELETE answered 404); returns its job."""
        entry = self._written.pop(uid, None)
        if entry is None:
            return None
        pods = self._by_job.get(entry[0], {})
        pods.pop(uid, None)
        if not pods:
            self._by_job.pop(entry[0], None)
        return entry[0]

    def observe(self, event_type: str | None, pod: Mapping[str, Any]) -> JobKey | None:
        """Apply one watch event (ADDED/MODIFIED/DELETED, None = listed); returns the pod's job."""
        found = self._identify(pod)
        if found is None:
            return None
        uid, key = found
        if event_type == "DELETED":
            self.forget(uid)
            view = pod_view(pod)
            if view.disrupted:
                # The pod is gone by the time the job reconciles; its last state says why.
                uids = self._disrupted.setdefault(key, {})
                uids[uid] = (view.owner_uid, view.attempt)
                for old in list(uids)[:-MAX_DISRUPTED_PODS]:
                    del uids[old]
        else:
            self._put(uid, key, pod_view(pod))
        return key

    def disrupted(self, key: JobKey, owner_uid: str, attempt: int) -> frozenset[str]:
        """uids of the pods of this job's ``attempt`` whose deletion a disruption caused (as far as watch
        events told); forgets those of earlier attempts and of an earlier job of the same name."""
        uids = self._disrupted.get(key, {})
        for uid, (owner, of_attempt) in list(uids.items()):
            if owner != owner_uid or (of_attempt or 0) < attempt:
                del uids[uid]
        if not uids:
            self._disrupted.pop(key, None)
        return frozenset(uid for uid, (_, of_attempt) in uids.items() if of_attempt == attempt)

    def begin_list(self) -> int:
        """Mark the start of a LIST; pass the mark to :meth:`replace`."""
        return next(self._seq)

    def replace(self, mark: int, pods: Iterable[Mapping[str, Any]], namespaces: set[str] | None) -> set[JobKey]:
        """Make the cache agree with a LIST started at ``mark``; returns the jobs whose pods changed.

        Args:
            namespaces: the namespaces the LIST covered (None: all).
        """
        listed = {found[0]: (found[1], pod) for pod in pods if (found := self._identify(pod))}
        changed: set[JobKey] = set()
        for uid, (key, seq) in list(self._written.items()):
            if seq < mark and uid not in listed and (namespaces is None or key[0] in namespaces):
                self.forget(uid)
                changed.add(key)
        for uid, (key, pod) in listed.items():
            old = self._written.get(uid)
            if old is not None and old[1] >= mark:
                continue  # an event newer than this LIST already wrote it
            view = pod_view(pod)
            if old is None or self._by_job[key].get(uid) != view:
                self._put(uid, key, view)
                changed.add(key)
        return changed

    def __getitem__(self, key: JobKey) -> list[PodView]:
        return list(self._by_job[key].values())

    def __iter__(self) -> Iterator[JobKey]:
        return iter(list(self._by_job))

    def __len__(self) -> int:
        return len(self._by_job)
