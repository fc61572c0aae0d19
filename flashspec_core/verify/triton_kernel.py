"""The fused verification kernel: one launch, two phases, no host sync.

Phase 1, one program per (sequence b, row j, chunk of V): online max / sum-exp of logits / T (or
the running argmax when greedy), written as a partial; the last program of b to finish combines
them, runs the acceptance tests and publishes the stopping row. Phase 2, one program per (b, tile
of V): waits for that row and sums the residual (or p) mass of its tile in float64; the last one
runs the inverse CDF and writes the outputs. Programs map an atomic ticket, not their program id,
to work and wait only on lower tickets, already running, so the wait cannot deadlock. Counters are
reset by their last user: no memset, one graph-replayable launch. Why and how: docs/verify_kernel.md.
"""
from __future__ import annotations

import triton
import triton.language as tl

PAD_TOKEN = tl.constexpr(-1)
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e) in float64, rounded once with T (`_scales`)

# Workspace layout (int32): [ticket, then per sequence: phase-1 count, phase-2 count, ready, step].
WS_SLOTS = 4


@triton.jit
def _stop_row_masses(logits_row: tl.tensor, q_row: tl.tensor, draft_tok: tl.tensor, offs: tl.tensor, V: tl.tensor,
                     m_row: tl.tensor, log_z: tl.tensor, inv_t: tl.tensor, temperature: tl.tensor,
                     rejected: tl.tensor, ONE_HOT: tl.constexpr,
                     RECIP: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """p and the residual max(0, p - q) (p itself at the bonus row) on one tile of the stopping row.

    logits_row: pointer to [V] logits of the stopping row; q_row: pointer to [V] draft probs of
    that row (read only when rejected and not ONE_HOT); offs: [BLOCK] int32 vocabulary indices.
    Returns p and r, both [BLOCK] float32, zero outside [0, V).
    """
    inb = offs < V
    x = tl.load(logits_row + offs, mask=inb, other=float("-inf")).to(tl.float32)
    if RECIP:  # logits / T rounded as torch rounds it: CUDA computes x * (1/T), the CPU divides
        y = x * inv_t
    else:
        y = tl.math.div_rn(x, temperature)
    p = tl.exp((y - m_row) - log_z)
    p = tl.where(inb, p, 0.0)
    if ONE_HOT:
        q = tl.where(offs == draft_tok, 1.0, 0.0)
    else:
        q = tl.load(q_row + offs, mask=offs < tl.where(rejected, V, 0), other=0.0).to(tl.float32)
    r = tl.where(rejected, tl.maximum(p - q, 0.0), p)
    return p, r


@triton.jit
def _scales(temp_ptr: tl.tensor, temperature: tl.tensor, b: tl.tensor,
            T_FROM_PTR: tl.constexpr) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Sequence b's float32 T (temp_ptr[b], or the launch's one `temperature`), 1/T and log2(e)/T.

    Computed here from T alone, so a sequence gets the same bits from a temperature per sequence
    as from that temperature for the whole launch: 1/T is the correctly rounded float32 quotient
    (what torch's CUDA multiplies logits by), log2(e)/T the float64 quotient rounded to float32.
    """
    if T_FROM_PTR:
        temperature = tl.load(temp_ptr + b)
    else:
        temperature = tl.cast(temperature, tl.float32)  # a no-op compiled; the interpreter passes a float
    inv_t = tl.math.div_rn(1.0, temperature)
    exp2_scale = (tl.full([], LOG2E, tl.float64) / temperature.to(tl.float64)).to(tl.float32)
    return temperature, inv_t, exp2_scale


@triton.jit(do_not_specialize=["seed", "seed_stride", "use_step", "B", "G", "NC", "TILES", "NT", "LAG"])
def verify_kernel(
    # Arguments are annotated `tl.tensor` (a pointer or a scalar inside a kernel), not int or float:
    # Triton reads those annotations as fixed i32 / fp32 types and would stop specialising on them.
    logits_ptr: tl.tensor, stride_lb: tl.tensor, stride_lg: tl.tensor,  # [B, G+1, V] bf16/fp16/fp32,
    # last dim contiguous
    draft_ptr: tl.tensor, stride_db: tl.tensor,  # [B, G] int64
    q_ptr: tl.tensor, stride_qb: tl.tensor, stride_qg: tl.tensor,  # [B, G, V] draft probs (any float),
    # unused when ONE_HOT
    u_ptr: tl.tensor, stride_ub: tl.tensor,  # [B, G+1] float32 uniforms, unused unless HAS_U
    seed_ptr: tl.tensor,  # [1] or [B] int64 seeds on the device, used when SEED_FROM_PTR
    seed: tl.tensor,  # host seed, used otherwise
    seed_stride: tl.tensor,  # 1: seed_ptr holds one seed per sequence (its draws leave b out); 0: one seed
    use_step: tl.tensor,  # 1: mix the per-sequence step counter into the Philox offset (graph replays)
    ws_ptr: tl.tensor,  # [1 + WS_SLOTS * B] int32 persistent, self-resetting counters
    fs_ptr: tl.tensor,  # float32 scratch: partial max [B, G+1, NC], partial sum [B, G+1, NC], stop [B, 3],
    # then at the next even index (8-byte aligned) the float64 tile masses [B, NT, 2]
    is_ptr: tl.tensor,  # int32 scratch: partial argmax [B, G+1, NC], partial bad flag [B, G+1, NC],
    # stop [B, 2]
    n_acc_ptr: tl.tensor,  # [B] int64 out
    tokens_ptr: tl.tensor,  # [B, G+1] int64 out
    temp_ptr: tl.tensor,  # [B] float32 temperatures on the device, one per sequence, used when T_FROM_PTR
    temperature: tl.tensor,  # float32 T of every sequence, used otherwise
    B: tl.tensor, G: tl.tensor, V: tl.tensor, NC: tl.tensor, TILES: tl.tensor, NT: tl.tensor, LAG: tl.tensor,
    BLOCK: tl.constexpr, GP: tl.constexpr, NCP: tl.constexpr, NTP: tl.constexpr,
    GREEDY: tl.constexpr, ONE_HOT: tl.constexpr, HAS_U: tl.constexpr,
    SEED_FROM_PTR: tl.constexpr, T_FROM_PTR: tl.constexpr, RECIP: tl.constexpr,
) -> None:
    rows = G + 1
    r1 = rows * NC  # phase-1 programs per sequence
    r2 = NT  # phase-2 programs per sequence (0 when greedy)
    if GREEDY:
        r2 = 0
    n_prog = B * (r1 + r2)

    ticket = tl.atomic_add(ws_ptr, 1, sem="relaxed")
    if ticket == n_prog - 1:
        tl.atomic_xchg(ws_ptr, 0, sem="relaxed")

    # Ticket -> work. Phase-2 work of sequence b is queued after phase-1 work of sequence b + LAG.
    head = LAG * r1
    mid = (B - LAG) * (r1 + r2)
    if ticket < head:
        phase = 1
        b = ticket // r1
        k = ticket % r1
    elif ticket < head + mid:
        g = LAG + (ticket - head) // (r1 + r2)
        k = (ticket - head) % (r1 + r2)
        if k < r1:
            phase = 1
            b = g
        else:
            phase = 2
            b = g - LAG
            k = k - r1
    else:
        phase = 2
        b = B - LAG + (ticket - head - mid) // r2
        k = (ticket - head - mid) % r2

    ws_b = ws_ptr + 1 + b * 4
    part_m = fs_ptr
    part_s = fs_ptr + B * r1
    stop_f = fs_ptr + 2 * B * r1 + b * 3
    masses_at = 2 * B * r1 + 3 * B
    masses = (fs_ptr + masses_at + masses_at % 2).to(tl.pointer_type(tl.float64))
    part_idx = is_ptr
    part_bad = is_ptr + B * r1
    stop_i = is_ptr + 2 * B * r1 + b * 2
    seq_logits = logits_ptr + b.to(tl.int64) * stride_lb
    ar = tl.arange(0, BLOCK)
    temperature, inv_t, exp2_scale = _scales(temp_ptr, temperature, b, T_FROM_PTR)

    if phase == 1:
        j = k // NC
        c = k % NC
        row = seq_logits + j.to(tl.int64) * stride_lg
        m = float("-inf")
        s = 0.0
        bad = 0
        best_val = float("-inf")
        best_idx = 0
        for t in range(TILES):
            offs = (c * TILES + t) * BLOCK + ar
            inb = offs < V
            x = tl.load(row + offs, mask=inb, other=float("-inf")).to(tl.float32)
            if GREEDY:
                bad = tl.maximum(bad, tl.max(tl.where(inb & ((x != x) | (x == float("inf"))), 1, 0)))
                tile_best = tl.max(x)
                tile_idx = (c * TILES + t) * BLOCK + tl.argmax(x, axis=0, tie_break_left=True)
                take = (tile_best > best_val) | ((t == 0) & (tile_best == best_val))
                best_idx = tl.where(take, tile_idx, best_idx)
                best_val = tl.where(take, tile_best, best_val)
            else:
                # Max of the raw logits (scaling by 1/T > 0 keeps the order) and sum of
                # exp((x - m) / T) as one FMA and one ex2 per element. NaN or +inf make s NaN,
                # which the finaliser reports, so no per-element check is needed here.
                new_m = tl.maximum(m, tl.max(x))
                safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
                s = s * tl.exp2((m - safe_m) * exp2_scale) + tl.sum(tl.exp2(x * exp2_scale - safe_m * exp2_scale))
                m = new_m
        slot = b * r1 + k
        if GREEDY:
            tl.store(part_m + slot, best_val)
            tl.store(part_idx + slot, best_idx)
        else:
            tl.store(part_m + slot, m)
            tl.store(part_s + slot, s)
        tl.store(part_bad + slot, bad)
        tl.debug_barrier()
        done = tl.atomic_add(ws_b, 1, sem="acq_rel")
        if done == r1 - 1:
            tl.debug_barrier()
            _accept(b, G, V, NC, seq_logits, stride_lg, draft_ptr, stride_db, q_ptr, stride_qb,
                    stride_qg, u_ptr, stride_ub, seed_ptr, seed, seed_stride, use_step, ws_b, part_m, part_s, part_idx,
                    part_bad, stop_f, stop_i, n_acc_ptr, tokens_ptr, temperature, inv_t, exp2_scale,
                    r1, GP, NCP, GREEDY, ONE_HOT, HAS_U, SEED_FROM_PTR, RECIP)
    else:
        ready = tl.atomic_add(ws_b + 2, 0, sem="acquire")
        while ready == 0:
            ready = tl.atomic_add(ws_b + 2, 0, sem="acquire")
        tl.debug_barrier()
        s_row = tl.load(stop_i, cache_modifier=".cg")
        m_row = tl.load(stop_f, cache_modifier=".cg")
        log_z = tl.load(stop_f + 1, cache_modifier=".cg")
        rejected = s_row < G
        q_j = tl.minimum(s_row, tl.maximum(G - 1, 0))
        draft_tok = tl.load(draft_ptr + b * stride_db + q_j, mask=rejected, other=-1)
        q_row = q_ptr + b.to(tl.int64) * stride_qb + q_j.to(tl.int64) * stride_qg
        logits_row = seq_logits + s_row.to(tl.int64) * stride_lg
        p, r = _stop_row_masses(logits_row, q_row, draft_tok, k * BLOCK + ar, V, m_row, log_z,
                                inv_t, temperature, rejected, ONE_HOT, RECIP)
        tl.store(masses + (b * NT + k) * 2, tl.sum(r.to(tl.float64)))
        tl.store(masses + (b * NT + k) * 2 + 1, tl.sum(p.to(tl.float64)))
        tl.debug_barrier()
        done = tl.atomic_add(ws_b + 1, 1, sem="acq_rel")
        if done == NT - 1:
            tl.debug_barrier()
            _sample(b, G, V, NT, masses, logits_row, q_row, draft_tok, draft_ptr, stride_db,
                    m_row, log_z, s_row, rejected, stop_f, stop_i, ws_b, n_acc_ptr, tokens_ptr,
                    temperature, inv_t, BLOCK, GP, NTP, ONE_HOT, RECIP)


@triton.jit
def _accept(b: tl.tensor, G: tl.tensor, V: tl.tensor, NC: tl.tensor, seq_logits: tl.tensor, stride_lg: tl.tensor,
            draft_ptr: tl.tensor, stride_db: tl.tensor, q_ptr: tl.tensor, stride_qb: tl.tensor,
            stride_qg: tl.tensor, u_ptr: tl.tensor, stride_ub: tl.tensor, seed_ptr: tl.tensor, seed: tl.tensor,
            seed_stride: tl.tensor, use_step: tl.tensor, ws_b: tl.tensor, part_m: tl.tensor, part_s: tl.tensor,
            part_idx: tl.tensor,
            part_bad: tl.tensor, stop_f: tl.tensor, stop_i: tl.tensor, n_acc_ptr: tl.tensor, tokens_ptr: tl.tensor,
            temperature: tl.tensor, inv_t: tl.tensor, exp2_scale: tl.tensor, r1: tl.tensor,
            GP: tl.constexpr, NCP: tl.constexpr, GREEDY: tl.constexpr, ONE_HOT: tl.constexpr,
            HAS_U: tl.constexpr, SEED_FROM_PTR: tl.constexpr, RECIP: tl.constexpr) -> None:
    """Last phase-1 program of sequence b: combine partials, run the acceptance tests.

    Reads the [G+1, NC] partials of sequence b and the [G] draft tokens; greedy writes the
    outputs here, sampling publishes (stop row, its max and log Z, the last uniform) to stop_f /
    stop_i and raises the ready flag for phase 2.
    """
    jj = tl.arange(0, GP)
    cc = tl.arange(0, NCP)
    tile_mask = (jj[:, None] <= G) & (cc[None, :] < NC)
    slots = b * r1 + jj[:, None] * NC + cc[None, :]
    bad = tl.max(tl.max(tl.load(part_bad + slots, mask=tile_mask, other=0, cache_modifier=".cg"), 1))
    pm = tl.load(part_m + slots, mask=tile_mask, other=float("-inf"), cache_modifier=".cg")
    row_max = tl.max(pm, 1)  # [GP]
    is_row = jj <= G
    bad = tl.maximum(bad, tl.max(tl.where(is_row & (row_max == float("-inf")), 1, 0)))
    is_draft = jj < G
    draft = tl.load(draft_ptr + b * stride_db + jj, mask=is_draft, other=0)
    bad = tl.maximum(bad, tl.max(tl.where(is_draft & ((draft < 0) | (draft >= V)), 1, 0)))
    draft = tl.where((draft >= 0) & (draft < V), draft, 0)
    if GREEDY:
        best_c = tl.argmax(pm, axis=1, tie_break_left=True)
        pidx = tl.load(part_idx + slots, mask=tile_mask, other=0, cache_modifier=".cg")
        target = tl.sum(tl.where(cc[None, :] == best_c[:, None], pidx, 0), 1)
        reject_at = tl.where(is_draft & (draft != target), jj, G)
        n_acc = tl.min(reject_at)
        out = tl.where((jj <= n_acc) & (bad == 0), target.to(tl.int64), PAD_TOKEN)
        n_out = tl.where(bad == 0, n_acc, -1).to(tl.int64)
        tl.store(tokens_ptr + b * (G + 1) + jj, out, mask=is_row)
        tl.store(n_acc_ptr + b, n_out)
        tl.atomic_xchg(ws_b, 0, sem="relaxed")
    else:
        ps = tl.load(part_s + slots, mask=tile_mask, other=0.0, cache_modifier=".cg")
        safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        z = tl.where(is_row, tl.sum(ps * tl.exp2((pm - safe_max[:, None]) * exp2_scale), 1), 1.0)
        bad = tl.maximum(bad, tl.max(tl.where(is_row & ((z != z) | (row_max == float("inf"))), 1, 0)))
        bad = tl.maximum(bad, tl.where((temperature > 0.0) & (temperature < float("inf")), 0, 1))  # NaN too
        log_z = tl.log(z)
        if RECIP:  # the partials hold raw logits; torch's max of logits / T is this, rounded alike
            row_max = row_max * inv_t
        else:
            row_max = tl.math.div_rn(row_max, temperature)
        rows = seq_logits + jj.to(tl.int64) * stride_lg
        x_draft = tl.load(rows + draft, mask=is_draft, other=0.0).to(tl.float32)
        if RECIP:
            y_draft = x_draft * inv_t
        else:
            y_draft = tl.math.div_rn(x_draft, temperature)
        logp = (y_draft - row_max) - log_z
        if HAS_U:
            u = tl.load(u_ptr + b * stride_ub + jj, mask=is_row, other=0.5)
        else:
            if SEED_FROM_PTR:
                key = tl.load(seed_ptr + b * seed_stride)
            else:
                key = seed
            step = tl.atomic_add(ws_b + 3, 0, sem="relaxed").to(tl.int64) * use_step
            # A sequence with a seed of its own draws the same numbers at any index b of a batch.
            u = tl.rand(key, (step * 65536 + b * (1 - seed_stride)) * 32 + jj.to(tl.int64))
        if ONE_HOT:
            accept = tl.log(u) < logp
        else:
            qd = tl.load(q_ptr + b.to(tl.int64) * stride_qb + jj.to(tl.int64) * stride_qg + draft,
                         mask=is_draft, other=1.0).to(tl.float32)
            accept = (qd > 0.0) & (tl.log(u) < logp - tl.log(qd))
        n_acc = tl.min(tl.where(is_draft & (accept == 0), jj, G))
        tl.store(stop_f, tl.sum(tl.where(jj == n_acc, row_max, 0.0)))
        tl.store(stop_f + 1, tl.sum(tl.where(jj == n_acc, log_z, 0.0)))
        tl.store(stop_f + 2, tl.sum(tl.where(jj == G, u, 0.0)))
        tl.store(stop_i, n_acc)
        tl.store(stop_i + 1, bad)
        tl.debug_barrier()
        tl.atomic_xchg(ws_b + 2, 1, sem="release")


@triton.jit
def _sample(b: tl.tensor, G: tl.tensor, V: tl.tensor, NT: tl.tensor, masses: tl.tensor, logits_row: tl.tensor,
            q_row: tl.tensor, draft_tok: tl.tensor, draft_ptr: tl.tensor, stride_db: tl.tensor, m_row: tl.tensor,
            log_z: tl.tensor, s_row: tl.tensor, rejected: tl.tensor, stop_f: tl.tensor, stop_i: tl.tensor,
            ws_b: tl.tensor, n_acc_ptr: tl.tensor, tokens_ptr: tl.tensor, temperature: tl.tensor, inv_t: tl.tensor,
            BLOCK: tl.constexpr, GP: tl.constexpr, NTP: tl.constexpr, ONE_HOT: tl.constexpr,
            RECIP: tl.constexpr) -> None:
    """Last phase-2 program of sequence b: inverse CDF over the [NT] tile masses, then one tile.

    Mirrors sample_from_probs: the first token with mass whose cumulative mass exceeds u * total,
    else the last token with mass. The residual is used when it has mass, p otherwise, like the
    reference. Tile masses, their scan and the in-tile scan are float64, as the reference's cumsum
    is: in float32, block sums and torch's running sum round ~1e-4 of the mass apart at V ~ 10^5
    and pick different tokens in ~0.2 % of rows; in float64 they agree to ~1e-16. Only this one
    row per sequence pays for float64.
    """
    tt = tl.arange(0, NTP)
    in_t = tt < NT
    mr = tl.load(masses + (b * NT + tt) * 2, mask=in_t, other=0.0, cache_modifier=".cg")
    mp = tl.load(masses + (b * NT + tt) * 2 + 1, mask=in_t, other=0.0, cache_modifier=".cg")
    use_r = tl.sum(mr) > 0.0
    w = tl.where(use_r, mr, mp)  # [NTP] float64
    u_last = tl.load(stop_f + 2, cache_modifier=".cg").to(tl.float64)
    goal = u_last * tl.sum(w)
    cum = tl.cumsum(w, 0)
    # "with mass": a parallel scan need not repeat the running sum exactly over a zero-mass tile
    first = tl.min(tl.where(in_t & (cum > goal) & (w > 0.0), tt, NTP))
    last_pos = tl.max(tl.where(in_t & (w > 0.0), tt, 0))
    tile = tl.where(first < NT, first, last_pos)
    before = tl.sum(tl.where(tt == tile - 1, cum, 0.0))

    ar = tl.arange(0, BLOCK)
    offs = tile * BLOCK + ar
    p, r = _stop_row_masses(logits_row, q_row, draft_tok, offs, V, m_row, log_z, inv_t,
                            temperature, rejected, ONE_HOT, RECIP)
    wt = tl.where(use_r, r, p).to(tl.float64)
    cum_t = before + tl.cumsum(wt, 0)
    i_first = tl.min(tl.where((offs < V) & (cum_t > goal) & (wt > 0.0), ar, BLOCK))
    i_last = tl.max(tl.where((offs < V) & (wt > 0.0), ar, 0))
    token = (tile * BLOCK + tl.where(i_first < BLOCK, i_first, i_last)).to(tl.int64)
    token = tl.minimum(token, V - 1)

    jj = tl.arange(0, GP)
    draft = tl.load(draft_ptr + b * stride_db + jj, mask=jj < G, other=0)
    ok = tl.load(stop_i + 1, cache_modifier=".cg") == 0
    out = tl.where(jj < s_row, draft, tl.where(jj == s_row, token, PAD_TOKEN))
    out = tl.where(ok, out, PAD_TOKEN)
    n_out = tl.where(ok, s_row, -1).to(tl.int64)
    tl.store(tokens_ptr + b * (G + 1) + jj, out, mask=jj <= G)
    tl.store(n_acc_ptr + b, n_out)
    tl.atomic_xchg(ws_b, 0, sem="relaxed")
    tl.atomic_xchg(ws_b + 1, 0, sem="relaxed")
    tl.atomic_xchg(ws_b + 2, 0, sem="relaxed")
    tl.atomic_add(ws_b + 3, 1, sem="relaxed")
