"""Spies for the model-loading tests: what a worker reads from a model's safetensors files, and
a DagWorker built only as far as its models."""

from contextlib import contextmanager

import torch


class _RecordedFile:
    """A safetensors handle that records the rows each read takes: (name, start, stop, of rows)."""

    def __init__(self, handle, reads: list) -> None:
        self.handle, self.reads = handle, reads

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, name):
        tensor = self.handle.get_tensor(name)
        self.reads.append((name, 0, tensor.shape[0], tensor.shape[0]))
        return tensor

    def get_slice(self, name):
        return _RecordedSlice(name, self.handle.get_slice(name), self.reads)


class _RecordedSlice:
    """A lazy safetensors slice that records the rows read from it."""

    def __init__(self, name: str, piece, reads: list) -> None:
        self.name, self.piece, self.reads = name, piece, reads

    def __getitem__(self, rows: slice):
        num_rows = self.piece.get_shape()[0]
        self.reads.append((self.name, *rows.indices(num_rows)[:2], num_rows))
        return self.piece[rows]


@contextmanager
def recording_reads():
    """Record what is read: the rows of every safetensors read, and ``from_pretrained`` calls."""
    import safetensors
    import transformers

    reads: list = []
    real_open = safetensors.safe_open
    real_from_pretrained = transformers.PreTrainedModel.__dict__["from_pretrained"]  # the classmethod itself

    def from_pretrained(cls, *args, **kwargs):
        reads.append(("from_pretrained", 0, 1, 1))
        return real_from_pretrained.__func__(cls, *args, **kwargs)

    safetensors.safe_open = lambda *a, **k: _RecordedFile(real_open(*a, **k), reads)
    transformers.PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    try:
        yield reads
    finally:
        safetensors.safe_open = real_open
        transformers.PreTrainedModel.from_pretrained = real_from_pretrained


def models_only_worker(spec_dict: dict, world: int, model_dir: str):
    """A DagWorker of ``spec_dict`` on rank ``dist.get_rank()`` of ``world`` (CPU), with nothing
    built yet: call its ``_build_models``."""
    from distflow.planner import build_plan
    from distflow.spec import parse_spec
    from distflow.spec.defaults import resolve_device_defaults
    from distflow.worker import DagWorker, WorkerEnv

    spec = resolve_device_defaults(parse_spec(spec_dict), "cpu")  # as DagWorker.__init__ does
    worker = DagWorker.__new__(DagWorker)  # the models only: no data, exporter or coordinator
    worker.spec, worker.plan, worker.device = spec, build_plan(spec), torch.device("cpu")
    worker.env = WorkerEnv(rank=torch.distributed.get_rank(), world_size=world, local_rank=0, local_world_size=1,
                           node_rank=0, num_nodes=1, master_addr="", master_port=0, job_name="t",
                           model_dir=model_dir, device_index=0)
    return worker
