"""DeltaKV's compression: which tokens of which requests are compressed when, and the device work
that turns their raw K/V into latents (the half of DeltaKVCacheManager that runs in `on_step_end`).

A compression "event" is planned once on the host, from counters the host knows, and its device
work is queued after the step's forward without synchronising: at a prefill chunk's end all at
once, at decode time a share of the sparse layers in each of the next `spread` decode steps.
"""
from typing import NamedTuple

import numpy as np
import torch

from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.staging import to_device
from sparsevllm.engine.step import StepState
from sparsevllm.kernels.deltakv import compress_block, gather_x, shortlist

COMPRESS_CHUNK = 8192   # tokens compressed together: [8192, 2 H D] fp32 + [8192, refs] distances
COMPRESS_REFS = 65536   # references a compression batch gathers: [65536, 2 H D] fp32 (512 MiB at 8 x 128)
SHORTLIST = 32          # GPU: candidates a token keeps from the bf16 ranking, then ranked exactly in fp32
REF_BUCKET = 1024       # GPU decode windows: references padded to a multiple (see _plan)
TOKEN_BUCKET = 64       # GPU decode windows: tokens padded to a multiple (see _plan)
SHORTLIST_TOKENS = 512  # GPU: the most tokens a request may compress for the shortlist, and tokens shortlisted
                        # together: [512, 32, 2 H D] fp32 candidates (64 MiB at 8 x 128)


class Request:
    """A running request's raw slots and how far it is compressed."""

    def __init__(self, row: int, max_len: int, sink: int):
        self.row = row
        self.slots = np.full(max_len + 1, -1, dtype=np.int32)   # raw slot per position, -1: none
        self.upto = 0                                           # positions [0, upto) got a raw slot
        self.comp_end = sink                                    # [sink, comp_end) is compressed
        self.prompt_end = 0                                     # its prompt's length
        self.event: Event | None = None                         # its decode-time compression under way
        self.dropped = False                                    # freed while that was under way


class Plan(NamedTuple):
    """One request's part of a compression: its token and reference positions, the latent slots its
    tokens take, and where its compressed prefix ends once the event finishes."""
    req: Request
    tok_pos: np.ndarray
    ref_pos: np.ndarray
    l_slots: np.ndarray
    end: int


def kept_tokens(plans: list[Plan], n: int, live) -> tuple[np.ndarray, np.ndarray]:
    """The live requests' real tokens as flat indices into the padded [B, n] batch, and the latent
    slots they take."""
    keep = np.concatenate([b * n + np.arange(len(plans[b].tok_pos)) for b in live])
    return keep, np.concatenate([plans[b].l_slots for b in live])


class Event:
    """A compression planned once and run a share of the sparse layers at a time: the requests'
    plans, their device tensors (see _plan), the layers done."""

    def __init__(self, plans: list[Plan], tensors: dict):
        self.plans, self.tensors = plans, tensors
        self.steps_done = 0
        self.layers_done = 0


class Compression:
    """Mixed into DeltaKVCacheManager: reads its storage (raw pool, latents, neighbours, raw map, raw
    slot stack), its requests and its codecs."""

    def on_step_end(self, step: StepState) -> None:
        jobs = []
        for seq, n in zip(step.seqs, step.num_tokens):
            req = self.requests[seq.seq_id]
            end = self.method_config.compress_to(req.comp_end, seq.cache_len + n)
            if end > req.comp_end and req.event is None:
                jobs.append((seq, req, req.comp_end, end))
        # Decode steps age out one window in many requests at once: compress those together (one
        # launch sequence a layer; one request at a time cost a 128K x 4 decode step 153 ms on the
        # H200, host-bound, against 48 ms batched). Groups bound the transient tensors: tokens x
        # references for the scores, references x F for their features; a prefill chunk goes alone.
        sink, stride = self.method_config.deltakv_sink, self.method_config.stride
        spread = 1 if step.is_prefill else self.spread
        jobs.sort(key=lambda job: job[3] - job[2])
        group, most_tokens, most_refs = [], 0, 0
        for job in jobs:
            tokens, refs = job[3] - job[2], sink + -(-(job[3] - sink) // stride)
            most_tokens, most_refs = max(most_tokens, tokens), max(most_refs, refs)
            grown = len(group) + 1
            if group and (grown * most_tokens > COMPRESS_CHUNK or grown * most_refs > COMPRESS_REFS):
                self._compress(group, spread)
                group, most_tokens, most_refs = [], tokens, refs
            group.append(job)
        if group:
            self._compress(group, spread)
        # A decode-time compression runs a share of the sparse layers each step: its ~65 launches a
        # layer cost the host ~2.5 ms a layer (a 128K x 4 event: 65-71 ms of host time for 21 ms of
        # GPU work on the H200), which overlapped scheduling hides behind the next forward only a
        # share at a time. Its tokens stay raw (and in the decode view's tail) until the last share.
        # Shares go with the steps that decode its requests, not prefill steps between them: where
        # prefills fall differs with overlapped scheduling (it admits a step later), the number of
        # tokens a request decodes before its compression takes effect must not.
        if not step.is_prefill and self.events:
            under_way = {id(self.requests[seq.seq_id].event) for seq in step.seqs}
            for event in [e for e in self.events if id(e) in under_way]:
                self._advance(event)

    def _compress(self, jobs: list[tuple[Sequence, Request, int, int]], spread: int = 1) -> None:
        """Compress positions [start, end) of each (seq, req, start, end) in every sparse layer and
        free their raw slots (references keep theirs): now (spread 1), or a share of the layers in
        each of the next `spread` decode steps of its requests, this one included."""
        event = Event(*self._plan(jobs))
        if spread == 1:
            self._run_layers(event, len(self.codecs))
            self._finish_event(event)
            return
        for _, req, _, _ in jobs:
            req.event = event
        self.events.append(event)

    def _advance(self, event: Event) -> None:
        event.steps_done += 1
        self._run_layers(event, event.steps_done * len(self.codecs) // self.spread)
        if event.steps_done == self.spread:
            self.events.remove(event)
            self._finish_event(event)

    def _drop(self, req: Request) -> None:
        """A request freed while its compression is under way: the other requests' compression goes
        on unchanged (the same steps with or without overlapped scheduling, which frees a step later);
        its own latents are no longer written (its pages may go to another request)."""
        event, req.event, req.dropped = req.event, None, True
        live = [b for b, p in enumerate(event.plans) if not p.req.dropped]
        if not live:
            self.events.remove(event)
            return
        t = event.tensors
        keep, l_slots = kept_tokens(event.plans, t["t_key"].shape[1], live)
        t["keep"], t["l_slots"] = torch.split(to_device(np.concatenate([keep, l_slots]), self.device),
                                              [len(keep), len(l_slots)])

    @torch.inference_mode()
    def _plan(self, jobs: list[tuple[Sequence, Request, int, int]]) -> tuple[list[Plan], dict]:
        """Host planning from host counters and the device tensors every layer reuses; queued after
        the forward, no synchronisation. The requests are padded to one batch: padding tokens sit at
        position -1 (no earlier reference: nothing chosen, nothing stored), padding references after
        every token (never chosen); both read a real slot at position 0."""
        knobs = self.method_config
        sink, stride, P = knobs.deltakv_sink, knobs.stride, self.page_size
        plans = []
        for seq, req, start, end in jobs:
            pos = np.arange(start, end)
            tok_pos = pos[(pos - sink) % stride != 0]
            ref_pos = np.concatenate([np.arange(sink), np.arange(sink, end, stride)])
            table = self.tables.arrays[seq.seq_id]
            plans.append(Plan(req, tok_pos, ref_pos, table[tok_pos // P].astype(np.int64) * P + tok_pos % P, end))
        B = len(plans)
        n, R = max(len(p.tok_pos) for p in plans), max(len(p.ref_pos) for p in plans)
        # Chunks of tokens bound the transient [B, chunk, F] and [B, chunk, R] tensors (a 128K prompt
        # is compressed at once), and each chunk is compared only with the references before it.
        # The shortlist pays where a pass over every reference serves few tokens (a decode step's
        # windows). A prefill chunk's thousands of tokens keep the full fp32 ranking: one dense GEMM
        # beats 16 shortlist rounds of candidate gathers (with the shortlist there too, 128K x 4
        # prefill fell from 5,200 to 4,700 tok/s on the H200).
        short = self.shortlist and n <= SHORTLIST_TOKENS
        c = max(1, (SHORTLIST_TOKENS if short else COMPRESS_CHUNK) // B)
        if short:
            # Decode windows padded so the GEMM shapes repeat from event to event: the first cuBLAS
            # call of a new shape costs the host 12-13 ms (the shortlist's [B, n, F] x [B, F, refs],
            # 128K x 4 on the H200, profiled), at every event's first layer as the references grow.
            # Padding tokens sit at position -1 and padding references after every token: never
            # chosen. No chunk is padding only (n stays within the chunks the real tokens need).
            n = min(-(-n // TOKEN_BUCKET) * TOKEN_BUCKET, -(-n // c) * c)
            R = -(-R // REF_BUCKET) * REF_BUCKET
        t_slots, r_slots = np.zeros((B, n), np.int64), np.zeros((B, R), np.int64)
        t_key, r_key = np.full((B, n), -1, np.int64), np.full((B, R), 1 << 40, np.int64)
        for b, (req, tok_pos, ref_pos, _, _) in enumerate(plans):
            t_slots[b], r_slots[b] = req.slots[ref_pos[0]], req.slots[ref_pos[0]]
            t_slots[b, :len(tok_pos)], t_key[b, :len(tok_pos)] = req.slots[tok_pos], tok_pos
            r_slots[b, :len(ref_pos)], r_key[b, :len(ref_pos)] = req.slots[ref_pos], ref_pos
        host = [t_slots.ravel(), t_key.ravel(), r_slots.ravel(), r_key.ravel(), *kept_tokens(plans, n, range(B))]
        parts = torch.split(to_device(np.concatenate(host), self.device), [len(h) for h in host])
        t_slots_d, t_key_d, r_slots_d, r_key_d = (t.view(B, -1) for t in parts[:4])
        t_rot, r_rot = t_key_d.clamp(min=0), r_key_d.where(r_key_d < (1 << 40), 0)   # rotation positions
        # Per chunk, what every layer reuses: the tokens' slots and rotations, flattened once.
        chunks = []
        for a in range(0, n, c):
            e = min(a + c, n)
            nref = max(int(np.searchsorted(p.ref_pos, p.tok_pos[min(e, len(p.tok_pos)) - 1]))
                       for p in plans if a < len(p.tok_pos))
            nref = min(R, -(-nref // REF_BUCKET) * REF_BUCKET) if short else nref
            chunks.append((a, e, nref, t_slots_d[:, a:e].flatten(), t_rot[:, a:e].flatten()))
        ref_meta = torch.stack([r_slots_d, r_rot, r_key_d]) if short else None   # one gather a layer picks all three
        return plans, dict(t_key=t_key_d, r_slots=r_slots_d, r_rot=r_rot, r_key=r_key_d, keep=parts[4],
                           l_slots=parts[5], chunks=chunks, short=short, ref_meta=ref_meta)

    @torch.inference_mode()
    def _run_layers(self, event: Event, upto: int) -> None:
        """Compress the event's tokens in sparse layers [layers_done, upto)."""
        t, knobs = event.tensors, self.method_config
        B, R = t["r_key"].shape
        short, t_key_d, r_key_d = t["short"], t["t_key"], t["r_key"]
        for i in range(event.layers_done, upto):
            codec = self.codecs[i]
            k_cache, v_cache = self.raw.layer(i)
            scales = self.raw.scales(i)   # an FP8 raw pool's, dequantized as gathered
            refs = gather_x(k_cache, v_cache, t["r_slots"].flatten(), t["r_rot"].flatten(), self.cos_sin,
                            torch.bfloat16 if short else torch.float32, *scales).view(B, R, -1)
            if short:
                ref_sq = torch.linalg.vector_norm(refs, dim=-1, dtype=torch.float32).square()   # no fp32 copy of refs
            zs, nbrs = [], []
            for a, e, nref, slots, rot in t["chunks"]:
                x = gather_x(k_cache, v_cache, slots, rot, self.cos_sin, torch.float32, *scales).view(B, e - a, -1)
                if short:   # each token's candidates, gathered again in fp32
                    idx = shortlist(x, refs[:, :nref], ref_sq[:, :nref], r_key_d[:, :nref], t_key_d[:, a:e],
                                    SHORTLIST)
                    c_slots, c_rot, c_key = t["ref_meta"].gather(2, idx.flatten(1).expand(3, -1, -1))
                    cand = gather_x(k_cache, v_cache, c_slots.flatten(), c_rot.flatten(),
                                    self.cos_sin, torch.float32, *scales).view(*idx.shape, -1)
                    z, nbr = compress_block(x, cand, c_key.view(idx.shape), t_key_d[:, a:e],
                                            knobs.deltakv_neighbors, codec)
                else:
                    z, nbr = compress_block(x, refs[:, :nref], r_key_d[:, :nref], t_key_d[:, a:e],
                                            knobs.deltakv_neighbors, codec)
                zs.append(z)
                nbrs.append(nbr)
            keep, l_slots = t["keep"], t["l_slots"]
            z = torch.cat(zs, 1).flatten(0, 1)[keep]
            self.latents[i][l_slots] = z.to(self.latents.dtype)
            self.neighbors[i][l_slots] = torch.cat(nbrs, 1).flatten(0, 1)[keep]
        event.layers_done = upto

    @torch.inference_mode()
    def _finish_event(self, event: Event) -> None:
        """Every layer holds the latents: mark the tokens compressed and free their raw slots. At
        least one request is live (_drop ends an event whose requests all left)."""
        live = [(p.req, p.tok_pos, p.end) for p in event.plans if not p.req.dropped]
        rows = np.concatenate([np.full(len(tok_pos), req.row) for req, tok_pos, _ in live])
        pos = np.concatenate([tok_pos for _, tok_pos, _ in live])
        dev = to_device(np.concatenate([rows, pos]).astype(np.int64), self.device)
        # A device-side -1: `raw_map[...] = -1` copies the scalar from pageable host memory, which
        # waits for the queued forward (~12 ms a 128K x 4 decode step on the H200, under overlap).
        self.raw_map.index_put_((dev[:len(rows)], dev[len(rows):]), self.compressed_mark)
        for req, tok_pos, end in live:
            self.raw_slots.give(req.slots[tok_pos])
            req.slots[tok_pos] = -1
            req.event, req.comp_end = None, end
