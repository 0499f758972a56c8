"""deltakv: residual latent compression of old tokens with a trained compressor (DeltaKV, arXiv
2602.08005; the authors' engine is the upstream Sparse-vLLM).

The package: config.py (knobs, the schedule and storage arithmetic), compressor.py (the trained
down/up projections and their file format; trained by `python -m sparsevllm.tools.train_deltakv`),
compression.py (what is compressed when, and the device work), manager.py (the cache manager:
storage, admission, step inputs, views).

What it computes. Full layers (`deltakv_full_layers`, default the paper's 0, 1, 2, 8, 18 of 32
scaled to the depth as round(f * L / 32), layer 0 always) keep every token raw. In the other
(sparse) layers the first `deltakv_sink` tokens and the recent window stay raw; older tokens are
compressed in blocks of whole windows as they age out: references (the sink and every s-th token
after it, s = round(1 / cluster_ratio)) stay raw, every other token t keeps only
z_t = down(x_t) - down(r_t), x_t = [K_t before RoPE ; V_t], r_t the mean of its
`deltakv_neighbors` nearest earlier references (L2), and the positions of those references; its
raw slot is freed. Each decode step, the full layer just before a run of sparse layers scores every
token (raw logits, max over query heads: a fused output of its own attention, as in OmniKV); the
first sparse layer of the run picks the top `deltakv_decode_keep` compressed tokens; every sparse
layer of the run rebuilds them (up(z) + r, RoPE at the true position) into scratch slots with the
sink and the raw tail, and attends to that (a page-size-1 decode view). All of it is tensor work
inside the CUDA graph.

Storage (the layout is this method's own):
- the paged pool of the base class, over the full layers only, with per slot the sparse layers'
  latents and reference positions beside it (a token's latent lives at its full-layer slot);
- a raw pool for the sparse layers with one-token slots: a token holds a slot until it is
  compressed, references and the sink forever; the slot allocator is a free stack on the host;
  room for one prefill step's new tokens and every request's sink and raw tail is reserved;
- per running request, a device row mapping position -> raw slot (-1: compressed), which the
  decode kernels read inside graphs;
- one scratch of max_num_seqs x (sink + decode_keep + raw tail) token slots, shared by the sparse
  layers (each fills it just before its attention); a prefill chunk's rebuilt prefix (one layer,
  made per step) is counted as max_model_len more.
Admission and `bytes_per_page` count exactly these.

When compression runs: in `on_step_end`, after every step (prefill chunks included), for a request
whose raw tail has reached `deltakv_compress_windows` + 1 windows (default 2): the oldest whole
windows are compressed, leaving one window raw; the requests of one step are compressed together,
as one padded batch. Bookkeeping is planned on the host from counters the host knows; the device
work (gathers, nearest references, the GEMMs) is queued after the step's forward and never
synchronises. A prefill chunk's compression runs at its step's end; a decode step's runs its
sparse layers in `deltakv_compress_steps` shares, one in each step that decodes its requests from
the one that starts it (host launches of ~2.5 ms a layer hide behind the forwards that way; prefill
steps between do not count), and its tokens stay raw, in the decode view's tail, until the last
share; a request freed meanwhile leaves it, the others' goes on.
Prefill is chunked: a chunk after the first attends (densely, unchanged math otherwise) to its
prefix as the sparse layers hold it, the compressed tokens rebuilt into a per-step scratch, as the
compressor was trained (attention over reconstructed KV). So a long prompt never sits raw in the
sparse layers beyond one chunk and its raw tail.

Deviations:
- Prefix caching is off (capabilities): a hit would share full-layer pages but not the sparse
  layers' raw slots and latents.
- The sparse layers' raw pool stores K after RoPE (prefill attention reads it); compression and
  reconstruction rotate references back by their positions (exact up to rounding).
- Qwen3's k-norm runs in the model before the cache hook, so the engine compresses the normed K
  (the paper: K before the norm, re-normed after reconstruction); the trainer learns on the same
  normed K, and no k-norm is applied again after reconstruction.
- up(z) and down(x) run as cuBLAS GEMMs (torch modules); the Triton kernels do the gathers, the
  reference means, the rotations and the scratch writes.
- Prefill compresses chunk by chunk, so a chunk after the first reads the compressed part of its
  prefix rebuilt from the latents rather than raw (this is what bounds a long prompt's raw memory).
  So outputs depend on the schedule: where a prompt's chunks end (a step's token budget shared
  with other prompts) decides which of its tokens later chunks read rebuilt.
- Preemption recomputes prompt + generated tokens by chunked prefill: the generated tokens then
  attend to their whole prefix (compressed part rebuilt), not to the decode view (sink + top
  decode_keep + raw tail) they attended to when generated, so a preempted request's continuation
  can differ from an uninterrupted run. With async_scheduling a tight pool can preempt where the
  synchronous engine does not (a finished request's extra step holds its pages a step longer),
  and it admits a prompt a step later, so where a step's token budget cuts chunks short they can
  end elsewhere; without preemption and with whole chunks the two give the same tokens (tested).
- The nearest references are ranked in fp32, a chunk of tokens at a time. On the GPU, when each
  request compresses at most 512 tokens (decode steps), a bf16 GEMM first shortlists 32 candidates a
  token and only those are ranked in fp32 (the fp32 GEMM against every reference was ~half of a
  128K x 4 decode compression); a true neighbour is lost only if bf16 rounding moves 32 others past
  it.
"""
from sparsevllm.engine.cache_manager.deltakv.config import DeltaKVConfig
from sparsevllm.engine.cache_manager.deltakv.manager import DeltaKVCacheManager

__all__ = ["DeltaKVCacheManager", "DeltaKVConfig"]
