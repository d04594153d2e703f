"""Predicted step time of a layout on a device profile.

Each compute action (a chunk's forward or backward of one microbatch) costs, unit by unit, its compute
and its FSDP traffic: the larger of the two where the device overlaps them (a GPU: the next unit's
all-gather is prefetched while this one computes; reductions run behind the backward), their sum where
it does not (gloo's threads on the cores the compute runs on):

    compute     TP-local GEMM FLOPs / (peak x the profile's efficiency at the GEMM's smaller side), plus
                the bytes the other ops (norms, rotary, SwiGLU's product, residual adds, the loss's
                softmax) read and write over the profile's elementwise bandwidth; the backward twice
                the forward, plus the recomputed forward of layer_ckpt; TP's and CP's exchanges are
                added (they sit between the GEMMs), the recomputed forward's again; CP's ring
                overlaps its attention
    FSDP        the unit's all-gather (every microbatch under reshard_after_forward, else the first)
                and, on a reducing microbatch, its reduce-scatter and HSDP's all-reduce
    links       every collective and transfer costs the link's latency plus its bytes over the link's
                bandwidth; a group whose ranks fit in one node uses the intra-node link, else the
                inter-node one

The pipeline programs run on the simulator (as the runtime runs them) with these costs and the p2p transfer
times; past 2 x pp microbatches the steady per-microbatch time is extrapolated. The optimizer's update
(HBM-bound) and the last reductions' drain close the step. More CPU ranks than cores share
them: the step is then at least the work of all ranks over the cores.
"""

from dataclasses import dataclass

from parallel.mesh import ParallelDims
from parallel.pipeline.schedule import BACKWARD, FORWARD, WEIGHT, Action, pipeline_actions
from parallel.pipeline.simulate import simulate
from planner.devices import DeviceProfile, oversubscribed_cores
from planner.units import rank_chunks, unit_sizes
from trainer.config.schema import TrainConfig
from trainer.config.vocab import planned_vocabulary
from trainer.observability.flops import training_flops_per_token

# Bytes an fp32 AdamW step moves per parameter (trainer/optimizer.py). Op by op: mul_ (the decay), lerp_
# (first moment), mul_ and addcmul_ (second), sqrt, div and add_ (the denominator), addcdiv_ (the
# update): 12 reads, 8 writes. optim.fused: parameter, gradient and both moments read once, three written.
ADAM_BYTES = {False: 20 * 4, True: 7 * 4}
# Elements a block's forward reads and writes per token outside its GEMMs, attention and norms, by width:
# dim (residual adds), q and kv (the TP-local rotated widths), hidden (TP-local SwiGLU). Eager, each op
# reads its inputs and writes its output once: two residual adds (3 each), rotary on q and k (negate,
# concatenate, two products, a sum: 10 each), silu and the gate product (5); sdpa's output, transposed,
# is contiguous (no copy). compile=true fuses rotary and SwiGLU into one pass over inputs and outputs.
BLOCK_ELEMENTS = {False: {"dim": 6, "q": 10, "kv": 10, "hidden": 5}, True: {"dim": 6, "q": 2, "kv": 2, "hidden": 3}}
# Bytes an eager RMSNorm moves per element of dim (model/transformer.py: in fp32 whatever the compute
# dtype): fp32, square, mean, scale and weight, 7 x 4; bf16 adds the casts up and back, 18 x 2.
EAGER_NORM_BYTES = {4: 7 * 4, 2: 18 * 2}
# The fp32 cross entropy's log-softmax over the TP-local vocabulary, per token.
LOSS_ELEMENTS = 4


@dataclass(frozen=True)
class StepTime:
    step_s: float
    tokens_per_s_per_device: float
    mfu: float
    bound: str  # compute | pipeline bubble | FSDP communication | TP/CP communication
    parts: dict[str, float]  # seconds per step on the slowest rank, by resource


@dataclass(frozen=True)
class _Costs:
    """Seconds per unit of one microbatch: compute of a forward, exposed TP/CP exchange of a forward."""

    block_forward: float
    head_forward: float
    weight: dict  # unit kind -> its weight-gradient GEMMs of one microbatch (zb_h1's W), seconds
    exchange: float  # per block, forward (the backward exchanges as much again)
    recompute: float  # per block, added to its backward
    recompute_exchange: float  # per block, the recomputed forward's exchanges, added to its backward
    gather: dict  # unit kind -> all-gather seconds
    reduce: dict  # unit kind -> reduce-scatter seconds (+ HSDP all-reduce on the last microbatch)
    replicas: dict  # unit kind -> HSDP all-reduce seconds (the step's last microbatch)
    numel: dict  # unit kind -> TP-local parameters
    hop: float  # p2p transfer of one activation or gradient


def _link(device: DeviceProfile, span: int) -> tuple[float, float]:
    """(seconds of latency, bytes per second) of a group whose ranks lie within `span` consecutive ranks."""
    if span <= device.gpus_per_node:
        return device.intra_node_latency_us * 1e-6, device.intra_node_gbps * 1e9
    return device.inter_node_latency_us * 1e-6, device.inter_node_gbps * 1e9


def _transfer_s(device: DeviceProfile, span: int, nbytes: float, count: int = 1) -> float:
    """Seconds of `count` collectives or transfers moving `nbytes` in all over such a group's link."""
    latency, bandwidth = _link(device, span)
    return count * latency + nbytes / bandwidth


def _compute_s(cfg: TrainConfig, dims: ParallelDims, device: DeviceProfile,
               dtype_bytes: int) -> tuple[float, float, float, dict[str, float]]:
    """Seconds of one microbatch's forward: (a block's, the head's, a block's attention product, the
    linears' GEMMs of a block and of the head, which the backward's weight gradients repeat)."""
    m, tp = cfg.model, dims.tp
    rows = cfg.microbatch_size * cfg.seq_len // dims.cp  # tokens of a microbatch on this rank
    peak = device.flops(dtype_bytes, m.use_fp8)
    attn_params = m.dim * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    gemms = rows * 2 * (attn_params + 3 * m.dim * m.ffn_hidden_dim) / tp
    # Causal attention computes half the score product, in the compute dtype (fp8 is for the linears).
    # CP's chunk pairs run a fused kernel too, unless efficient_attn=math: the plain formula in fp32
    # (parallel/context_parallel/kernels.py, pair_kernel).
    attention = rows * 2 * m.n_heads * m.head_dim * cfg.seq_len / tp
    plain_fp32 = dims.cp > 1 and m.efficient_attn == "math"
    attention_peak = device.flops(4 if plain_fp32 else dtype_bytes)
    attention_s = attention / (attention_peak * device.efficiency(rows, m.head_dim))
    linears = {"block": gemms / (peak * device.efficiency(rows, min(m.dim, m.ffn_hidden_dim) // tp)),
               "head": rows * 2 * m.dim * m.vocab_size / tp / (device.flops(dtype_bytes)
                                                               * device.efficiency(rows, m.vocab_size // tp))}
    block_bytes, head_bytes = _elementwise_bytes(cfg, dims, dtype_bytes)
    return (linears["block"] + attention_s + rows * block_bytes / device.elementwise_bytes_per_s,
            linears["head"] + rows * head_bytes / device.elementwise_bytes_per_s, attention_s, linears)


def _elementwise_bytes(cfg: TrainConfig, dims: ParallelDims, dtype_bytes: int) -> tuple[float, float]:
    """Bytes a block's and the head's forward move per token outside GEMMs and attention. Under sequence
    parallelism the norms and residual adds see 1/tp of the tokens."""
    m, tp = cfg.model, dims.tp
    dim = m.dim / tp if m.sequence_parallel and tp > 1 else m.dim
    widths = {"dim": dim, "q": m.n_heads * m.head_dim / tp, "kv": m.n_kv_heads * m.head_dim / tp,
              "hidden": m.ffn_hidden_dim / tp}
    block = sum(count * widths[width] for width, count in BLOCK_ELEMENTS[cfg.compile].items()) * dtype_bytes
    # A compiled norm reads its input and writes its output once; the head is never compiled.
    norm = EAGER_NORM_BYTES[dtype_bytes]
    block += 2 * dim * (2 * dtype_bytes if cfg.compile else norm)
    return block, norm * dim + LOSS_ELEMENTS * m.vocab_size / tp * 4


def _activation_bytes(cfg: TrainConfig, dims: ParallelDims, dtype_bytes: int) -> int:
    """One microbatch's hidden states on a rank (its CP share of the sequence, full width)."""
    return cfg.microbatch_size * cfg.seq_len // dims.cp * cfg.model.dim * dtype_bytes


def _exchange_s(cfg: TrainConfig, dims: ParallelDims, device: DeviceProfile, dtype_bytes: int,
                attention_s: float) -> dict[str, float]:
    """Seconds of a block's TP and of its CP exchanges in one forward (the backward's mirror them)."""
    m, tp, cp, mb = cfg.model, dims.tp, dims.cp, cfg.microbatch_size
    activation = _activation_bytes(cfg, dims, dtype_bytes)
    exchange = {"tp": 0.0, "cp": 0.0}
    if tp > 1:  # two gathers and two reduce-scatters (SP) or two all-reduces, each of an activation's (tp-1)/tp
        exchange["tp"] = _transfer_s(device, tp, 4 * activation * (tp - 1) / tp, 4 if m.sequence_parallel else 2)
    if cp > 1:  # K and V: two all-gathers, or cp - 1 hops of the ring (which overlap the attention)
        kv = 2 * mb * cfg.seq_len * (m.n_kv_heads // tp) * m.head_dim * dtype_bytes * (cp - 1) / cp
        if cfg.context_parallel_comm == "all_gather":
            exchange["cp"] = _transfer_s(device, tp * cp, kv, 2)
        else:
            exchange["cp"] = max(0.0, _transfer_s(device, tp * cp, kv, cp - 1) - attention_s)
    return exchange


def _costs(cfg: TrainConfig, dims: ParallelDims, device: DeviceProfile, dtype_bytes: int) -> _Costs:
    m, tp, cp = cfg.model, dims.tp, dims.cp
    block_forward, head_forward, attention_s, linears = _compute_s(cfg, dims, device, dtype_bytes)
    exchange = _exchange_s(cfg, dims, device, dtype_bytes, attention_s)
    recompute = {"none": 0.0, "full": block_forward, "selective": attention_s}[m.layer_ckpt]
    # The recomputed forward runs its collectives again: the block's (full), the attention core's CP exchange
    # (selective: TP's gathers and reductions sit outside the core).
    recompute_exchange = {"none": 0.0, "full": exchange["tp"] + exchange["cp"],
                          "selective": exchange["cp"]}[m.layer_ckpt]
    world, r = dims.dp_shard * cp, dims.dp_replicate
    shard_span, replica_span = tp * cp * dims.dp_shard, dims.world_size // dims.pp
    together = dims.pp * cfg.virtual_pipeline_stages == 1 and m.tie_embeddings
    sizes = unit_sizes(m, tp, together)
    numel = {"embedding": sizes.embedding, "block": sizes.block, "head": sizes.head}
    reduce_bytes = 4 if cfg.reduce_dtype == "fp32" else 2
    sharded, replicated = int(world > 1), int(r > 1)
    gather = {k: _transfer_s(device, shard_span, n * dtype_bytes * (world - 1) / world, sharded) for k, n in numel.items()}
    reduce = {k: _transfer_s(device, shard_span, n * reduce_bytes * (world - 1) / world, sharded) for k, n in numel.items()}
    replicas = {k: _transfer_s(device, replica_span, 2 * n / world * reduce_bytes * (r - 1) / r, replicated)
                for k, n in numel.items()}
    # Neighbouring pipeline stages are world / pp ranks apart.
    activation = _activation_bytes(cfg, dims, dtype_bytes)
    hop = _transfer_s(device, dims.world_size // dims.pp + 1, activation / (tp if m.sequence_parallel and tp > 1 else 1))
    return _Costs(block_forward, head_forward, {**linears, "embedding": 0.0}, exchange["tp"] + exchange["cp"],
                  recompute, recompute_exchange, gather, reduce, replicas, numel, hop)


def _unit_times(c: _Costs, kinds: list[str], op: str, cfg: TrainConfig, first: bool, last: bool,
                overlap: bool) -> tuple[float, float, float]:
    """(seconds, of which compute, of which weight-gradient GEMMs) of one action over the chunk's units."""
    total = compute = weight = 0.0
    gathers = cfg.reshard_after_forward or (first and op == FORWARD)
    reduces = op == BACKWARD and (last or cfg.grad_reduce == "per_microbatch")
    for kind in kinds:
        work = {"block": c.block_forward, "head": c.head_forward, "embedding": 0.0}[kind]
        exchange = c.exchange if kind == "block" else 0.0
        if op == BACKWARD:
            work = 2 * work + (c.recompute if kind == "block" else 0.0)
            exchange += c.recompute_exchange if kind == "block" else 0.0
        comm = (c.gather[kind] if gathers else 0.0) + (c.reduce[kind] if reduces else 0.0)
        comm += c.replicas[kind] if reduces and last else 0.0
        total += max(work + exchange, comm) if overlap else work + exchange + comm
        compute += work
        weight += c.weight[kind] if op == BACKWARD else 0.0
    return total, compute, weight


def compute_lower_bound(cfg: TrainConfig, dims: ParallelDims, device: DeviceProfile, dtype_bytes: int) -> float:
    """Seconds no step of the layout can beat: the busiest rank's compute alone."""
    c = _costs(cfg, dims, device, dtype_bytes)
    work = {"block": 3 * c.block_forward + c.recompute, "head": 3 * c.head_forward, "embedding": 0.0}
    return cfg.num_microbatches * max(sum(work[kind] for chunk in rank_kinds(cfg, r) for kind in chunk)
                                      for r in range(dims.pp))


def rank_kinds(cfg: TrainConfig, pp_rank: int) -> list[list[str]]:
    """The kinds of a rank's units, chunk by chunk, in forward order."""
    return [["embedding"] * ch.embedding + ["block"] * ch.blocks + ["head"] * ch.head for ch in rank_chunks(cfg, pp_rank)]


def predict(cfg: TrainConfig, dims: ParallelDims, device: DeviceProfile, dtype_bytes: int) -> StepTime:
    cfg = planned_vocabulary(cfg)
    device = device.latencies_for(dims.world_size)
    c = _costs(cfg, dims, device, dtype_bytes)
    pp, vpp, microbatches = dims.pp, cfg.virtual_pipeline_stages, cfg.num_microbatches
    simulated = _simulated_microbatches(microbatches, pp)
    kinds = {r: rank_kinds(cfg, r) for r in range(pp)}
    computing: dict[Action, float] = {}
    overlap = device.overlaps_communication

    def cost(a: Action) -> float:
        """A backward's weight-gradient GEMMs are W's, the rest B's (the simulator adds W to B in a program
        without W)."""
        if not a.is_compute:
            return c.hop
        op = BACKWARD if a.op == WEIGHT else a.op
        seconds, work, weight = _unit_times(c, kinds[a.rank][a.chunk], op, cfg, a.microbatch == 0,
                                            a.microbatch == simulated - 1, overlap)
        if op == BACKWARD:
            seconds, work = (weight, weight) if a.op == WEIGHT else (seconds - weight, work - weight)
        computing[a] = work
        return seconds

    timeline = simulate(pipeline_actions(cfg.pipeline_schedule, pp, vpp, simulated), pp, vpp, cost,
                        sends_block=False, receives_ahead=device.name == "cpu", v_shape=cfg.pipeline_v_shape)
    # Past the simulated microbatches every rank repeats its steady forward and backward.
    steady = {r: sum(_unit_times(c, k, op, cfg, False, False, overlap)[0] for k in kinds[r] for op in (FORWARD, BACKWARD))
              for r in range(pp)}
    extra = microbatches - simulated
    makespan = timeline.makespan + extra * max(steady.values())
    slowest = max(range(pp), key=lambda r: timeline.busy(r) + extra * steady[r])
    busy = timeline.busy(slowest) + extra * steady[slowest]
    compute = sum(w for a, w in computing.items() if a.rank == slowest) * microbatches / simulated
    exchange = (2 * c.exchange + c.recompute_exchange) * microbatches * sum(k.count("block") for k in kinds[slowest])
    shard_elements = sum(c.numel[kind] for chunk in kinds[slowest] for kind in chunk) / (dims.dp_shard * dims.cp)
    optimizer = shard_elements * ADAM_BYTES[cfg.optim.fused] / (device.hbm_gbps * 1e9)
    drain = c.reduce["block"] + c.replicas["block"]
    step = makespan + optimizer + drain
    cores = oversubscribed_cores(device, dims.world_size)
    if cores:
        step = max(step, _shared_cores_bound(cfg, dims, device, dtype_bytes, cores, optimizer + drain))
    tokens = cfg.batch_size * dims.dp * cfg.seq_len
    flops = training_flops_per_token(cfg.model, cfg.seq_len) * tokens
    peak = device.flops(2)  # MFU against the dense bf16 peak, as the trainer logs `mfu`, whatever the compute dtype
    parts = {"compute": compute, "pipeline bubble": max(0.0, makespan - busy),
             "FSDP communication": max(0.0, busy - compute - exchange), "TP/CP communication": exchange,
             "optimizer": optimizer + drain}
    bound = "compute" if compute >= 0.5 * step else max((k for k in parts if k != "compute"), key=parts.get)
    return StepTime(step, tokens / step / dims.world_size, flops / (step * dims.world_size * peak), bound, parts)


def _shared_cores_bound(cfg: TrainConfig, dims: ParallelDims, device: DeviceProfile, dtype_bytes: int, cores: int,
                        closing: float) -> float:
    """More CPU ranks than cores: a rank idle in a bubble or blocked in a wait leaves its core to the
    others, so the step is at least every rank's work (compute and bytes moved, not the latencies
    waited out) over the cores. `closing`: a rank's optimizer update and last reductions."""
    c, m = _costs(cfg, dims, device.without_latency(), dtype_bytes), cfg.num_microbatches

    def microbatch(kinds: list[list[str]], first: bool, last: bool) -> float:
        return sum(_unit_times(c, chunk, op, cfg, first, last, False)[0] for chunk in kinds for op in (FORWARD, BACKWARD))

    work = 0.0
    for r in range(dims.pp):
        kinds = rank_kinds(cfg, r)
        ends = microbatch(kinds, True, m == 1) + (microbatch(kinds, False, True) if m > 1 else 0.0)
        work += ends + max(0, m - 2) * microbatch(kinds, False, False)
    return (work * (dims.world_size // dims.pp) + dims.world_size * closing) / cores


def _simulated_microbatches(microbatches: int, pp: int) -> int:
    """Enough microbatches for every rank to reach its steady state (1F1B's warm-up is under pp)."""
    return min(microbatches, 2 * pp)
