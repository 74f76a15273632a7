"""Weight sync between processes: a ``(name, tensor)`` stream sent in buckets over a process group.

:class:`WeightSender` (one trainer rank) packs the stream into buckets of ``bucket_bytes``
(default 512 MB; a tensor larger than that travels alone, from its own storage) and sends each
to one :class:`WeightReceiver` (the sampler) over a ``torch.distributed`` process group of the
user's choosing: one made with ``torch.distributed.new_group`` when both sides share a world, or
:func:`connect` for a group of its own between processes of different worlds (a 2-rank megatron
trainer and a 1-rank sampler). Every bucket goes as three messages: a control word (int64
``[magic, kind, version, bucket, header bytes, payload bytes]``), a JSON header (each tensor's
name, dtype, shape, offset in the payload and which part of the version it belongs to; the last
bucket also carries the version's totals) and the payload bytes.

One :meth:`WeightSender.send` is one *version* (numbered 1, 2, ... per sender unless given).
The receiver stages every bucket of a version in its own buffers and checks the bucket order,
the version number and the last bucket's totals before :meth:`WeightReceiver.receive` returns
it, so a version cut short (the sender died, a timeout, a bad header) raises
:class:`WeightSyncError` and nothing of it reaches the model. The receiver therefore holds one
version (the model's size for a full sync, the adapter's for an adapter-only one) while staging.

Every wait is bounded: the sender raises :class:`WeightSyncError` when a receiver that died or
stopped receiving has not taken a message within ``timeout`` seconds (gloo's send waits for the
peer's matching receive). A sender that fails still iterates the rest of its streams before it
raises, so the trainer ranks' collectives inside ``get_hf_state_dict`` finish together; after a
failure the group's state is unknown (a message may be half sent) and both objects refuse
further use: make a new group. A stream that raises on the sender (not the group) aborts the
version: the receiver raises :class:`WeightSyncError` for it, applies nothing, and both objects
stay usable.

Tensors travel on CPU over gloo; over nccl / hccl the buckets live on the accelerator (``device``)
and the waits are the backend's (the nccl watchdog enforces the group's timeout). Only the gloo
path runs in this repository's tests.

Receiver loop (a sampler process)::

    group = weight_sync.connect(rank=1, world_size=2, host=trainer_host, port=port)
    receiver = weight_sync.WeightReceiver(group, src=0, timeout=600)
    for version in receiver:                 # until the sender's close()
        version.apply(hf_model)              # or vllm_model.load_weights(iter(version))
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import time
from typing import Iterable, Iterator, List, Optional, Tuple

import torch

from .load import prepare_copies

MAGIC = 0x7457_5359_4E43   # "tWSYNC": a stray message on the group is refused, not misread
BUCKET, CLOSE, ACK, NACK, ABORT = 1, 2, 3, 4, 5
_CONTROL = 6
_ALIGN = 64   # payload offsets: every dtype's view of the bytes is aligned
_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[str(getattr(torch, _name))] = getattr(torch, _name)


class WeightSyncError(RuntimeError):
    """A version could not be sent or received whole (peer gone, timeout, bad message)."""


@dataclasses.dataclass
class SyncStats:
    """One :meth:`WeightSender.send`: the version number, how many tensors / bytes / buckets
    went, and the wall-clock seconds of the whole send (including producing the stream)."""
    version: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def connect(rank: int, world_size: int = 2, *, host: str = "127.0.0.1", port: Optional[int] = None, backend: str = "gloo",
            timeout: float = 300.0, store=None, prefix: str = "twinkle_weight_sync"):
    """A process group of its own for the weight sync, outside the default world: e.g. trainer
    rank 0 (``rank=0``) and a sampler process (``rank=1``) that is no part of the trainer's
    megatron world. Rendezvous over a ``torch.distributed.TCPStore`` at ``host:port`` (rank 0
    hosts it), or ``store`` (an existing store; keys go under ``prefix``). ``timeout``: seconds,
    the group's default wait (the rendezvous and every message). ``backend``: "gloo", or
    "nccl" (CUDA tensors). Returns the group (``.send`` / ``.recv`` / ``.rank()`` / ``.size()``),
    which :class:`WeightSender` and :class:`WeightReceiver` take with ranks inside it."""
    import torch.distributed as dist
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size={world_size!r}: a sync group has at least a sender and a receiver")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be in [0, {world_size})")
    wait = datetime.timedelta(seconds=_positive("timeout", timeout))
    if store is None:
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"port={port!r}: give the rendezvous port (or store=)")
        store = dist.TCPStore(host, port, world_size, rank == 0, timeout=wait)
    store = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, wait)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = wait
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"backend={backend!r} must be 'gloo' or 'nccl' (hccl groups: dist.new_group)")


def _positive(what: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{what} must be a positive number of seconds, got {value!r}")
    return float(value)


def _check_peer(group, peer, what: str) -> None:
    for method in ("send", "recv", "rank", "size"):
        if not hasattr(group, method):
            raise TypeError(f"group must be a torch.distributed process group, got {type(group).__name__}")
    if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < group.size():
        raise ValueError(f"{what}={peer!r} must be a rank of the group (0..{group.size() - 1})")
    if peer == group.rank():
        raise ValueError(f"{what}={peer} is this process's own rank in the group")


def _default_device(group, device):
    if device is not None:
        return torch.device(device)
    name = group.name() if hasattr(group, "name") else "gloo"
    if name == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if name == "hccl":
        return torch.device("npu", torch.npu.current_device())
    return torch.device("cpu")


class _Channel:
    """Point-to-point messages to / from one peer, every wait bounded by ``timeout``."""

    def __init__(self, group, peer: int, timeout: float, device: torch.device):
        self.group, self.peer, self.device = group, peer, device
        self.timeout = datetime.timedelta(seconds=timeout)
        self.broken: Optional[str] = None

    def _wait(self, op, t: torch.Tensor, what: str, timeout=None) -> None:
        wait = self.timeout if timeout is None else datetime.timedelta(seconds=timeout)
        try:
            op([t], self.peer, 0).wait(wait)
        except Exception as e:   # gloo raises RuntimeError for a timeout and for a closed peer
            self.broken = f"{what}: {type(e).__name__}: {e}"
            raise WeightSyncError(f"{what}: not done within {wait.total_seconds():g} s (rank {self.peer} of "
                                  f"the sync group stalled or is gone): {e}") from e

    def send(self, t: torch.Tensor, what: str, timeout=None) -> None:
        self._wait(self.group.send, t, what, timeout)

    def recv(self, t: torch.Tensor, what: str, timeout=None) -> torch.Tensor:
        self._wait(self.group.recv, t, what, timeout)
        return t

    def control(self, kind: int, version: int, seq: int, header: int, payload: int) -> torch.Tensor:
        return torch.tensor([MAGIC, kind, version, seq, header, payload], dtype=torch.int64, device=self.device)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class WeightSender:
    """Sends versions of a weight stream to the receiver at rank ``dst`` of ``group``.

    ``bucket_bytes``: the bucket size (default 512 MB; one buffer of that size is allocated on
    first use and reused); ``timeout``: seconds any one message may wait for the receiver;
    ``device``: where buckets live (default: CPU for gloo, the current accelerator for
    nccl / hccl). Use on the one trainer rank that receives the stream
    (``model.get_hf_state_dict(receivers="rank0")`` on global rank 0); the other trainer ranks
    iterate their (empty) streams alongside, or use :class:`TrainerSync`, which does both.
    """

    def __init__(self, group, dst: int, bucket_bytes: int = 512 << 20, timeout: float = 300.0, device=None):
        _check_peer(group, dst, "dst")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < _ALIGN:
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be an int >= {_ALIGN}")
        self.bucket_bytes = bucket_bytes
        self._ch = _Channel(group, dst, _positive("timeout", timeout), _default_device(group, device))
        self._bucket: Optional[torch.Tensor] = None
        self.version = 0   # the last version sent

    def send(self, *streams: Iterable[Tuple[str, torch.Tensor]], version: Optional[int] = None) -> SyncStats:
        """Send one version made of ``streams`` (each an iterable of ``(name, tensor)``; the
        receiver keeps them apart as the version's parts, e.g. the base weights and then an
        adapter's). ``version``: its number (default: the last one + 1; it must increase).
        Returns the :class:`SyncStats`. Raises :class:`WeightSyncError` if the receiver fails
        to take a message within the timeout (after iterating the rest of the streams)."""
        if not streams:
            raise ValueError("send() needs at least one stream")
        if version is None:
            version = self.version + 1
        if isinstance(version, bool) or not isinstance(version, int) or version <= self.version:
            raise ValueError(f"version={version!r} must be an int above the last one sent ({self.version})")
        items = ((part, name, t) for part, stream in enumerate(streams) for name, t in stream)
        if self._ch.broken is not None:
            _drain(items)
            raise WeightSyncError(f"the sync group failed before ({self._ch.broken}); make a new one")
        start = time.perf_counter()
        try:
            stats = self._send(items, version, len(streams))
        except WeightSyncError:
            _drain(items)   # the trainer ranks' collectives inside the streams finish together
            raise
        except BaseException:   # the stream itself failed: the receiver drops what it staged
            try:
                self._ch.send(self._ch.control(ABORT, version, 0, 0, 0), f"version {version} (abort)")
            except WeightSyncError:
                pass   # the stream's own error is the one to see; the group is marked broken
            raise
        self.version = version
        stats.seconds = time.perf_counter() - start
        return stats

    def close(self) -> None:
        """Tell the receiver no more versions come (its iteration ends)."""
        if self._ch.broken is None:
            self._ch.send(self._ch.control(CLOSE, self.version, 0, 0, 0), "close")

    def _send(self, items, version: int, parts: int) -> SyncStats:
        entries: List[list] = []
        fill = seq = tensors = nbytes = 0
        if self._bucket is None:
            self._bucket = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self._ch.device)
        for part, name, t in items:
            if not isinstance(name, str):
                raise TypeError(f"stream names must be strings, got {type(name).__name__}")
            if not torch.is_tensor(t):
                raise TypeError(f"stream tensor {name!r} is a {type(t).__name__}, not a tensor")
            if str(t.dtype) not in _DTYPES:
                raise TypeError(f"stream tensor {name!r}: dtype {t.dtype} cannot be sent")
            size = t.numel() * t.element_size()
            tensors, nbytes = tensors + 1, nbytes + size
            entry = [name, str(t.dtype), list(t.shape), 0, size, part]
            if size > self.bucket_bytes:   # alone, from its own storage
                if entries:
                    self._flush(version, seq, entries, fill)
                    seq, entries, fill = seq + 1, [], 0
                self._flush(version, seq, [entry], size, payload=_as_bytes(t.to(self._ch.device)))
                seq += 1
                continue
            offset = -(-fill // _ALIGN) * _ALIGN
            if offset + size > self.bucket_bytes:
                self._flush(version, seq, entries, fill)
                seq, entries, offset = seq + 1, [], 0
            entry[3] = offset
            self._bucket[offset:offset + size].copy_(_as_bytes(t))
            entries.append(entry)
            fill = offset + size
        totals = {"tensors": tensors, "bytes": nbytes, "buckets": seq + 1, "parts": parts}
        self._flush(version, seq, entries, fill, totals=totals)
        # gloo completes a small send once the bytes are buffered, so only the receiver's word that
        # it holds the whole version shows it is alive and took it
        ack = self._ch.recv(torch.zeros(_CONTROL, dtype=torch.int64, device=self._ch.device),
                            f"version {version} (the receiver's acknowledgement)").tolist()
        if ack[:3] != [MAGIC, ACK, version]:
            why = "refused it" if ack[:2] == [MAGIC, NACK] else f"answered {ack}"
            self._ch.broken = f"version {version}: the receiver {why}"
            raise WeightSyncError(f"version {version}: the receiver {why} (see the receiver's error)")
        return SyncStats(version, tensors, nbytes, seq + 1, 0.0)

    def _flush(self, version, seq, entries, fill, payload=None, totals=None) -> None:
        header = json.dumps({"version": version, "bucket": seq, "tensors": entries, "totals": totals}).encode()
        head = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self._ch.device)
        what = f"version {version} bucket {seq}"
        self._ch.send(self._ch.control(BUCKET, version, seq, head.numel(), fill), what + " (control)")
        self._ch.send(head, what + " (header)")
        if fill:
            self._ch.send(self._bucket[:fill] if payload is None else payload, what + " (payload)")


def _drain(items) -> None:
    for _ in items:
        pass


class WeightVersion:
    """One whole received version: ``version`` (its number), ``parts`` (one list of
    ``(name, tensor)`` per stream the sender sent, tensors viewing the receiver's staging
    buffers: read-only, alive as long as this object), ``nbytes``. Iterating it yields every
    ``(name, tensor)`` of every part (vLLM: ``model.load_weights(iter(version))``)."""

    def __init__(self, version: int, parts: List[List[Tuple[str, torch.Tensor]]], nbytes: int):
        self.version, self.parts, self.nbytes = version, parts, nbytes

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for part in self.parts:
            yield from part

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def apply(self, hf_model: torch.nn.Module, adapter_name: Optional[str] = None) -> int:
        """Copy the version into ``hf_model`` (a transformers model, or a peft model for base
        and adapter parts) in place, each part as :func:`load_hf_weights` would; every part is
        checked (names, shapes, dtypes, completeness) before the first copy, so a version that
        does not fit the model changes nothing. Returns the number of tensors copied."""
        copies = [prepare_copies(hf_model, part, adapter_name) for part in self.parts if part]
        with torch.no_grad():
            for plan in copies:
                for target, tensor in plan:
                    target.copy_(tensor)
        return sum(len(p) for p in copies)


class WeightReceiver:
    """Receives the versions a :class:`WeightSender` at rank ``src`` of ``group`` sends.

    ``timeout``: seconds to wait for the next version to start and for each later message of
    it (a trainer step may take long: be generous); ``device``: where the tensors land
    (default: CPU for gloo, the current accelerator for nccl / hccl). Iterating the receiver
    yields :class:`WeightVersion` objects until the sender closes.
    """

    def __init__(self, group, src: int, timeout: float = 600.0, device=None):
        _check_peer(group, src, "src")
        self._ch = _Channel(group, src, _positive("timeout", timeout), _default_device(group, device))
        self.version = 0   # the last version received whole
        self.closed = False
        self._started = 0   # the version being received
        self._refused = False   # a malformed message (not a transport failure) ended it

    def __iter__(self) -> Iterator[WeightVersion]:
        while True:
            v = self.receive()
            if v is None:
                return
            yield v

    def receive(self, timeout: Optional[float] = None) -> Optional[WeightVersion]:
        """The next whole version (None once the sender has closed). ``timeout``: seconds to wait
        for it to start (default: the receiver's). Raises :class:`WeightSyncError` for a
        version cut short or malformed; nothing of it is returned."""
        if self.closed:
            return None
        if self._ch.broken is not None:
            raise WeightSyncError(f"the sync group failed before ({self._ch.broken}); make a new one")
        wait = None if timeout is None else _positive("timeout", timeout)
        try:
            version = self._receive(wait)
        except WeightSyncError:
            if self._refused and self._started:
                try:   # best effort: tell the sender now instead of letting it time out
                    self._ch.send(self._ch.control(NACK, self._started, 0, 0, 0), "refusal", timeout=1.0)
                except WeightSyncError:
                    pass
            raise
        if version is not None:
            self._ch.send(self._ch.control(ACK, version.version, 0, 0, 0),
                          f"version {version.version} (acknowledgement)")
            self.version = version.version
        return version

    def _receive(self, wait) -> Optional[WeightVersion]:
        self._started = 0
        parts: List[List[Tuple[str, torch.Tensor]]] = []
        seq, version, nbytes, count = 0, None, 0, 0
        while True:
            ctrl = torch.empty(_CONTROL, dtype=torch.int64, device=self._ch.device)
            what = "the next version" if version is None else f"version {version} bucket {seq}"
            ctrl = self._ch.recv(ctrl, what + " (control)", wait if version is None else None).tolist()
            magic, kind, v, s, head_bytes, payload_bytes = ctrl
            if magic != MAGIC or kind not in (BUCKET, CLOSE, ABORT):
                self._fail(f"{what}: not a weight-sync message (control {ctrl})")
            if kind == ABORT:   # the sender's stream raised: drop this version, the group stays usable
                raise WeightSyncError(f"version {v}: the sender aborted it (its stream raised); nothing of it "
                                      "was applied")
            if kind == CLOSE:
                if version is not None:
                    self._fail(f"version {version}: the sender closed after bucket {seq - 1}, before the last")
                self.closed = True
                return None
            if version is None:
                if v <= self.version:
                    self._fail(f"version {v} arrived after version {self.version}: versions must increase")
                version = self._started = v
            if v != version or s != seq:
                self._fail(f"version {version}: got bucket {s} of version {v}, expected bucket {seq}")
            head = self._ch.recv(torch.empty(head_bytes, dtype=torch.uint8, device=self._ch.device),
                                 what + " (header)")
            header = json.loads(head.cpu().numpy().tobytes().decode())
            payload = torch.empty(payload_bytes, dtype=torch.uint8, device=self._ch.device)
            if payload_bytes:
                self._ch.recv(payload, what + " (payload)")
            if header.get("version") != version or header.get("bucket") != seq:
                self._fail(f"version {version} bucket {seq}: header says version {header.get('version')} "
                           f"bucket {header.get('bucket')}")
            for name, dtype, shape, offset, size, part in header["tensors"]:
                numel = 1
                for d in shape:
                    numel *= d
                if (dtype not in _DTYPES or offset < 0 or offset + size > payload_bytes
                        or numel * _DTYPES[dtype].itemsize != size):
                    self._fail(f"version {version} bucket {seq}: tensor {name!r} ({dtype}, shape {shape}, "
                               f"{size} bytes at {offset}) does not fit the {payload_bytes}-byte payload")
                t = payload[offset:offset + size].view(_DTYPES[dtype]).view(shape)
                while len(parts) <= part:
                    parts.append([])
                parts[part].append((name, t))
                nbytes, count = nbytes + size, count + 1
            seq += 1
            totals = header.get("totals")
            if totals is not None:
                break
        got = {"tensors": count, "bytes": nbytes, "buckets": seq}
        if any(totals[k] != got[k] for k in got) or len(parts) > totals["parts"]:
            self._fail(f"version {version}: the last bucket's totals {totals} do not match what arrived {got}")
        parts += [[] for _ in range(totals["parts"] - len(parts))]
        return WeightVersion(version, parts, nbytes)

    def _fail(self, message: str):
        self._ch.broken, self._refused = message, True
        raise WeightSyncError(message)

    def apply(self, hf_model: torch.nn.Module, adapter_name: Optional[str] = None,
              timeout: Optional[float] = None) -> Optional[int]:
        """Receive the next version and apply it to ``hf_model`` (:meth:`WeightVersion.apply`);
        returns its version number, or None once the sender has closed."""
        v = self.receive(timeout)
        if v is None:
            return None
        v.apply(hf_model, adapter_name)
        return v.version


__all__ = ["WeightSender", "WeightReceiver", "WeightVersion", "WeightSyncError", "SyncStats", "connect"]
