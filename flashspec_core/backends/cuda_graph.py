"""A target on CUDA: static KV cache, one CUDA graph per (batch, width), greedy verify in the graph.

The forward runs over `StaticLlama`'s fixed buffers, replayed from a graph. A step copies ids and
positions into the graph's inputs, replays, and in greedy mode the same graph takes the argmax at
every position and counts the accepted prefix, so the host reads back [n_accepted, tokens...] per
row. A chunk no decode graph holds (a prompt, a catch-up) replays the graph of PREFILL_WIDTH piece
by piece; rows' host records (prefix reuse, rollback by length, growth) are `StaticRows'`. The
last SCRATCH slots of each row are where graphs are warmed and captured, so no row holds a token
there. On the CPU the same class runs eagerly (the tests). Why and how: docs/backends.md.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from flashspec_core.backends.base import TargetRunner, WhileWaiting
from flashspec_core.backends.graph_step import GraphStep
from flashspec_core.backends.static_llama import StaticLlama
from flashspec_core.backends.static_rows import SCRATCH, StaticRows
from flashspec_core.models import vocab_size
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.verify import draw_seed, kernel_samples

MAX_SAMPLED_ROWS = 256  # rows the Triton kernel's workspace holds from the start (verify/triton.py)
# Past this many sampled graphs, a sampled step of a new (rows, width, q kind) runs eagerly. The
# engine's all fit (2 q kinds x 17 widths at one row: 1 and γ + 1 for γ <= 16); a direct caller
# stepping sampled batches of many sizes must not fill the GPU with graphs of [rows, width, V].
MAX_SAMPLED_GRAPHS = 34
# warm() captures sampled graphs at this many rows only: the engine replays a sampled step's graph
# for a lone row (step.py `_fused`: each sampled row draws from its own generator); at every batch
# size they would hold [rows, width, V] logits no step reads (memory_plan.step_bytes counts one row).
SAMPLED_WARM_ROWS = 1
PLACEHOLDER = -1  # a host record's token fed from the device and not read back yet (feed_tokens)
INITIAL_LEN = 2048
# Prompt chunks wider than every decode width replay a graph of this width once per piece. Eagerly,
# a prompt forward costs several times more the first time its length is met (kernels are picked
# per shape), which is most requests of an agent: each feeds a prompt of a new length.
PREFILL_WIDTH = 256
# When at most 1/ROW_SHARE of the rows feed a prompt, each feeds alone, through a graph of one row
# that reads and writes its cache row by index: a scheduler's newcomer beside 63 decoding rows
# would otherwise compute 64 rows of PREFILL_WIDTH tokens per piece.
ROW_SHARE = 4
# A graph's key: rows (0: one row picked by index), width, and for a sampled step whether q is
# one-hot (None: greedy). No temperature: a sampled graph reads each row's from a buffer.
GraphKey = tuple[int, int, bool | None]


def graphed_sampling(sampling: SamplingParams, vocab: int) -> bool:
    """Whether a sampled step can verify inside the graph: the Triton kernel takes temperature,
    not top-k / top-p (those need a sort per row; they run eagerly through `verify`)."""
    return not sampling.greedy and kernel_samples(sampling, vocab)


def launched(device: torch.device) -> Callable[[], bool]:
    """Whether the work queued on `device`'s stream so far is still running (asked without waiting)."""
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    return lambda: not done.query()


class GraphedModel(StaticRows, TargetRunner):
    """The `TargetRunner` contract on a static cache, with graphs on CUDA.

    model: a Llama-family HF model (`static_llama.supports`). graphs: capture CUDA graphs (default:
    when the model is on CUDA). fuse: the fewer-kernel forward (default: with graphs). Capture
    happens at the first step of each (batch, width) and again after the cache grows (`max_len`
    doubles when a request needs more).
    """

    def __init__(self, model: PreTrainedModel, pad_token_id: int, max_len: int = INITIAL_LEN,
                 graphs: bool | None = None, fuse: bool | None = None) -> None:
        self.model = model
        on_cuda = model.get_output_embeddings().weight.device.type == "cuda"
        self.use_graphs = on_cuda if graphs is None else graphs
        if fuse is None:  # fusing concatenates weight matrices: not those of a 4-bit model
            fuse = self.use_graphs and not getattr(model, "is_loaded_in_4bit", False)
        StaticRows.__init__(self, StaticLlama(model, max_len, batch=1, fuse=fuse), pad_token_id, self.use_graphs,
                            pad=PREFILL_WIDTH if self.use_graphs else 0)
        self.device = self.static.device
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("graphs=True needs the model on a CUDA device")
        self._graphs: dict[GraphKey, GraphStep] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._lock = threading.Lock()  # one replay at a time: graphs share buffers and the cache
        self.captures = 0  # how many graphs were captured (warm-up cost, reported by benchmarks)
        # warmup_seconds (StaticRows) adds the captures: one-time costs that land inside whichever
        # step triggered them; the engine tells the router, which must not charge them to that
        # step's arm (one capture costs as much as a hundred steps).
        self.widths: tuple[int, ...] = ()  # greedy steps are padded up to one of these (see warm)
        self.prefill_width = 0  # set by warm: wider chunks replay a graph of this width per piece
        self._seconds: dict[tuple[int, int], float] = {}  # (rows, width) -> a greedy replay's seconds

    def step_seconds(self) -> dict[int, float]:
        rows = self.static.batch
        return {w: s for (b, w), s in self._seconds.items() if b == rows and w in self.widths}

    def _drop_graphs(self) -> None:
        """Forget every graph, and capture the next ones into a new memory pool.

        A pool whose graphs have all been released cannot take a new capture: the caching
        allocator asserts (`use_count > 0`) when one is begun into it. Whether the old graphs are
        gone by then depends on the garbage collector, so a recapture after growth could fail in a
        long-running server and not in a short test.
        """
        self._graphs.clear()
        if self.use_graphs:
            self._pool = torch.cuda.graph_pool_handle()

    # ------------------------------------------------------------------ forwards

    def _graph(self, width: int, sampled: bool = False, one_hot: bool = True, indexed: bool = False) -> GraphStep:
        head = self.model.get_output_embeddings().weight
        weights = (head.data_ptr(), tuple(head.shape))
        if weights != getattr(self, "_weights", None):  # a trained draft swapped its head rows
            self._drop_graphs()
            self._weights = weights
        key = (0, width, None) if indexed else self._key(width, sampled, one_hot)
        graph = self._graphs.get(key)
        if graph is None:
            start = time.perf_counter()
            # In the scratch slots; wider (the prefill graph), past every row's end.
            slot = self.static.max_len - SCRATCH if width <= SCRATCH else max(len(h) for h in self.held)
            graph = self._graphs[key] = GraphStep(self.static, 1 if indexed else self.static.batch, width, self._pool,
                                                  slot, sampled, one_hot, indexed)
            torch.cuda.synchronize(self.device)
            self.captures += 1
            self.warmup_seconds += time.perf_counter() - start
        return graph

    def warm(self, widths: Sequence[int], sampled: bool = True, prefill_width: int = PREFILL_WIDTH) -> None:
        """Capture the graphs of `widths` now (the engine passes 1 and γ + 1 for each γ), and from
        then on pad every greedy step to the smallest of them that fits; and the graph of
        `prefill_width` (0: none), which then runs every wider chunk piece by piece (with, once
        there are ROW_SHARE rows or more, its one-row indexed twin).

        sampled: also, at SAMPLED_WARM_ROWS rows or fewer, the sampled one-hot graph of each width
        (a copy draft's sampled step, or one without a draft, at any temperature), so that no such
        step captures mid-request. A model draft's sampled steps (q in a buffer) still capture
        their graph at first use, once per width.

        Why pad: a copy draft proposes anywhere from 1 to γ tokens, so unpadded steps would each
        capture a graph of their width in the middle of some request. Padded columns cannot change
        the result: they sit after the row's real tokens, which causal attention never lets them
        influence, and their draft slots hold -1, which no target token equals.
        """
        if not self.use_graphs:
            return
        widths = sorted({int(w) for w in widths if 1 <= int(w) <= SCRATCH})
        with self._lock:
            for width in widths:
                fresh = self._key(width, False, True) not in self._graphs
                graph = self._graph(width)
                if fresh:  # the token budget's table (budget.py): a step's seconds by rows and width
                    self._seconds[self.static.batch, width] = graph.time_replay()
                if sampled and self.static.batch <= SAMPLED_WARM_ROWS:
                    self._graph(width, sampled=True)
            self.widths = tuple(widths)
            if widths and prefill_width > widths[-1]:
                self._ensure(max(len(h) for h in self.held) + prefill_width)
                self._graph(prefill_width)
                if self.static.batch >= ROW_SHARE:
                    self._graph(prefill_width, indexed=True)
                self.prefill_width = prefill_width

    def _key(self, width: int, sampled: bool, one_hot: bool) -> GraphKey:
        """A graph's key: rows, width, and for a sampled step the kind of q its verification
        takes (a step of width 1 has no draft, so no q)."""
        return self.static.batch, width, (one_hot or width == 1) if sampled else None

    def _sampled_graphs_full(self, width: int, one_hot: bool) -> bool:
        """Whether a sampled step would capture a graph past MAX_SAMPLED_GRAPHS."""
        sampled = sum(1 for k in self._graphs if k[2] is not None)
        return self._key(width, True, one_hot) not in self._graphs and sampled >= MAX_SAMPLED_GRAPHS

    def _graph_width(self, chunks: Sequence[Sequence[int]], active: Sequence[bool]) -> int | None:
        """The width of the graph that runs these chunks, or None to run them eagerly.

        Every active row must feed the same number of tokens c. After `warm`, c pads up to the
        smallest warmed width that holds it, and any other c runs eagerly: a prompt or catch-up
        chunk of an odd size would otherwise capture a graph to replay once, which costs more than
        the eager forward. Before any warm-up, each c up to SCRATCH is captured as met.
        """
        if not self.use_graphs:
            return None
        lengths = {len(c) for c, a in zip(chunks, active) if a}
        if len(lengths) != 1:
            return None
        (c,) = lengths
        if not self.widths:
            return c if c <= SCRATCH else None
        return self._warmed_width(c)

    def _warmed_width(self, tokens: int) -> int | None:
        """The smallest warmed width that holds `tokens` columns (None: none does)."""
        return next((w for w in self.widths if w >= tokens), None)

    def _replay(self, chunks: Sequence[Sequence[int]], graph_width: int, drafts: Sequence[Sequence[int]] | None = None,
                temperatures: Sequence[float] | None = None,
                draft_probs: torch.Tensor | None = None, seed: torch.Tensor | None = None,
                first: torch.Tensor | None = None) -> GraphStep:
        """Replay the graph of `graph_width` on these chunks, a sampled step's when `temperatures`
        (one per row) is given; the other arguments go to `GraphStep.replay`."""
        self._ensure(max(len(h) for h in self.held) + graph_width)  # padded columns need slots too
        graph = self._graph(graph_width, temperatures is not None, one_hot=draft_probs is None)
        graph.replay(self._host_inputs(chunks, graph_width, drafts), draft_probs, seed, first,
                     temperatures=temperatures)
        return graph

    @torch.inference_mode()
    def forward_to(self, sequences: Sequence[Sequence[int]], active: Sequence[bool] | None = None,
                   keep_logits: int = 1) -> torch.Tensor:
        """Make each active row hold `sequences[b]`; return [B, keep_logits, V] logits after its last
        tokens (inactive rows: meaningless). Same contract as `CachedModel.forward_to`."""
        active = [True] * len(sequences) if active is None else list(active)
        with self._lock:
            chunks = self._plan(sequences, active, keep_logits)
            width = max(len(c) for c in chunks)
            graph_width = self._graph_width(chunks, active)
            if graph_width is not None:  # every active chunk is `width` long, left-aligned
                logits = self._replay(chunks, graph_width).logits[:, width - keep_logits:width]
            elif self._in_pieces(chunks, active, keep_logits):
                return self._prefill_in_pieces(chunks, active, keep_logits)
            else:
                host = self._host_inputs(chunks, width).to(self.device)
                full = self.static(host[0], host[1])  # [B, width, V]
                ends = torch.tensor([max(len(c), keep_logits) for c in chunks], device=self.device)
                cols = ends[:, None] - keep_logits + torch.arange(keep_logits, device=self.device)
                logits = full.gather(1, cols[..., None].expand(-1, -1, full.shape[-1]))
            for b, chunk in enumerate(chunks):
                self.held[b].extend(chunk)
            return logits.clone() if self.use_graphs else logits

    def _in_pieces(self, chunks: Sequence[Sequence[int]], active: Sequence[bool], keep_logits: int) -> bool:
        """Whether these chunks run as replays of the prefill graph: there is one, and each active
        row's last piece holds every position whose logits are asked for. Rows may feed different
        lengths (a server's batch of prompts): a shorter row's later pieces feed only padding."""
        if not self.prefill_width:
            return False
        return all((len(c) - 1) % self.prefill_width + 1 >= keep_logits for c, a in zip(chunks, active) if a)

    def _prefill_in_pieces(self, chunks: Sequence[Sequence[int]], active: Sequence[bool],
                           keep_logits: int) -> torch.Tensor:
        """Feed the chunks prefill_width tokens at a time, each piece one replay (padded where a
        row's piece is short or empty); return [B, keep_logits, V], each active row's logits taken
        from the replay of its own last piece (inactive rows: zeros)."""
        width, out = self.prefill_width, None
        fed = [b for b, a in enumerate(active) if a]
        if len(fed) * ROW_SHARE <= len(chunks) and (0, width, None) in self._graphs:
            return self._prefill_rows(chunks, fed, keep_logits)
        for lo in range(0, max(len(c) for c in chunks), width):
            pieces = [c[lo:lo + width] for c in chunks]
            graph = self._replay(pieces, width)
            if out is None:
                out = graph.logits.new_zeros((len(chunks), keep_logits, graph.logits.shape[-1]))
            for b, piece in enumerate(pieces):
                self.held[b].extend(piece)
                if active[b] and lo < len(chunks[b]) <= lo + width:  # row b ends here: copied before the next replay
                    out[b] = graph.logits[b, len(piece) - keep_logits:len(piece)]
        assert out is not None, "chunks: at least one row feeds tokens (forward_to checks it)"
        return out

    def _prefill_rows(self, chunks: Sequence[Sequence[int]], fed: Sequence[int], keep_logits: int) -> torch.Tensor:
        """`_prefill_in_pieces` for a few rows `fed` among many: each row's pieces replay the
        one-row indexed graph on its own cache row, so the other rows cost nothing."""
        width, out = self.prefill_width, None
        for b in fed:
            chunk = chunks[b]
            for lo in range(0, len(chunk), width):
                piece = chunk[lo:lo + width]
                self._ensure(len(self.held[b]) + width)
                graph = self._graph(width, indexed=True)
                graph.replay(self._host_inputs([piece], width, first_row=b), slots=[b])
                self.held[b].extend(piece)
                if out is None:
                    out = graph.logits.new_zeros((len(chunks), keep_logits, graph.logits.shape[-1]))
                if lo + width >= len(chunk):  # row b's last piece: copied before the next replay
                    out[b] = graph.logits[0, len(piece) - keep_logits:len(piece)]
        assert out is not None, "fed: at least one row feeds tokens"
        return out

    @torch.inference_mode()
    def score_step(self, sequences: Sequence[Sequence[int]], needs: Sequence[int],
                   drafts: Sequence[Sequence[int] | None], active: Sequence[bool],
                   while_waiting: WhileWaiting | None = None
                   ) -> tuple[list[list[int] | None], list[torch.Tensor | None]] | None:
        """One greedy graph replay for rows of different draft lengths and settings (see the
        `TargetRunner` contract); None when no warmed width holds the longest row's feed (the
        rows were then only rolled back to what their caches hold).

        Each active row feeds its own tail, at least its last needs[b] tokens, left-aligned and
        padded to the smallest warmed width that holds the longest (padded columns change no
        row's logits: `warm`). A row whose feed is exactly its last token and its draft drafts[b]
        is verified in the graph; its draft slots past len(drafts[b]) hold -1, which no target
        token equals, so a shorter draft is never accepted past its end. A row verified
        elsewhere gets its logits instead.
        """
        if not self.use_graphs or not self.widths:
            return None
        with self._lock:
            chunks = self._plan(sequences, active, needs)
            graph_width = self._warmed_width(max(len(c) for c in chunks))
            if graph_width is None:
                return None
            in_graph = [a and d is not None and len(c) == len(d) + 1 for a, d, c in zip(active, drafts, chunks)]
            graph = self._replay(chunks, graph_width,
                                 [d if d is not None and ok else [] for d, ok in zip(drafts, in_graph)])
            logits: list[torch.Tensor | None] = [  # [need, V] each, copied before the next replay
                graph.logits[b, len(c) - needs[b]:len(c)].clone() if active[b] and not in_graph[b] else None
                for b, c in enumerate(chunks)]
            if while_waiting is not None:
                while_waiting(launched(self.device))
            result = graph.result.cpu().tolist()  # the step's one sync
            for b, chunk in enumerate(chunks):
                self.held[b].extend(chunk)
        if any(ok and r[0] < 0 for ok, r in zip(in_graph, result)):
            raise ValueError("the target's logits hold NaN or +inf; check the model's weights and dtype")
        verified = [r if ok else None for ok, r in zip(in_graph, result)]
        return verified, logits

    @torch.inference_mode()
    def feed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token to every row and return the logits after it, without the host reading
        the tokens: a model draft's loop feeds each drafted token back this way, so drafting γ
        tokens queues γ replays and syncs once, not once per token.

        tokens: [B] long on the device. Returns [B, 1, V]. Each row's host record holds
        `PLACEHOLDER` for the token (no real token equals it, so prefix reuse stops there) until
        `settle` writes the tokens in.
        """
        with self._lock:
            chunks = [[self.pad_token_id] for _ in self.held]  # column 0's id comes from `tokens`
            active = [True] * len(chunks)
            width = self._graph_width(chunks, active)
            if width is None:
                self._ensure(max(len(h) for h in self.held) + 1)
                host = self._host_inputs(chunks, 1).to(self.device)
                host[0, :, 0] = tokens
                logits = self.static(host[0], host[1])
            else:
                logits = self._replay(chunks, width, first=tokens).logits[:, :1].clone()
            for held in self.held:
                held.append(PLACEHOLDER)
            return logits

    def settle(self, tokens: Sequence[Sequence[int]]) -> None:
        """Write the tokens fed by `feed_tokens` (B lists, oldest first) over their placeholders."""
        for held, row in zip(self.held, tokens):
            n = len(row)
            if n and held[-n:] == [PLACEHOLDER] * n:
                held[-n:] = row

    @torch.inference_mode()
    def verify_step(self, contexts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]],
                    active: Sequence[bool], sampling: SamplingParams, draft_probs: torch.Tensor | None = None,
                    generator: torch.Generator | None = None,
                    while_waiting: WhileWaiting | None = None) -> tuple[list[int], list[list[int]]] | None:
        """One step in one graph replay: feed each active row's context + draft, verify in the
        graph and return (n_accepted per row, tokens per row), or None when this step cannot
        replay a graph (rows at different widths, top-k / top-p, a generator off the GPU, more
        rows than the kernel's workspace holds); the caller then runs forward_to and `verify`.

        draft_probs: [B, γ, V] the draft's q on the device, None for a copy draft (one-hot).
        Greedy steps pad to a warmed width; sampled ones replay the graph of their exact width and
        q kind, whatever the temperature (copied in per row): `warm` captured the one-hot graphs
        of the warmed widths, any other is captured at first use (counted in `warmup_seconds`).
        A sampled step's seed is drawn from `generator` as the eager kernel draws it (same tokens
        for the same generator state). Raises ValueError on NaN or +inf logits.
        while_waiting: host work run between the replay's launch and its one sync (the engine
        learns from the previous step there); called only when this returns a result.
        """
        if not self.use_graphs:
            return None
        greedy = sampling.greedy
        if not greedy and (not graphed_sampling(sampling, vocab_size(self.model)) or generator is None
                           or generator.device.type != "cuda" or len(contexts) > MAX_SAMPLED_ROWS):
            return None
        width = len(drafts[next(b for b, a in enumerate(active) if a)]) + 1
        sequences = [list(c) + list(d) for c, d in zip(contexts, drafts)]
        with self._lock:
            chunks = self._plan(sequences, active, width)
            graph_width = self._graph_width(chunks, active) if greedy else width
            if graph_width is None or any(len(c) != width for c, a in zip(chunks, active) if a):
                return None  # rows were only rolled back to what their caches hold
            if greedy:
                graph = self._replay(chunks, graph_width, drafts)
            elif self._sampled_graphs_full(width, draft_probs is None):
                return None  # the rows were only rolled back, as above
            else:
                seed = draw_seed(generator, self.device)
                temperatures = [sampling.temperature] * len(chunks)  # one setting for all rows, for now
                graph = self._replay(chunks, width, drafts, temperatures, draft_probs, seed)
            if while_waiting is not None:
                while_waiting(launched(self.device))
            result = graph.result.cpu().tolist()  # the step's one sync
            for b, chunk in enumerate(chunks):
                self.held[b].extend(chunk)
        n_acc = [r[0] for r in result]
        if any(n < 0 for n, a in zip(n_acc, active) if a):
            raise ValueError("the target's logits hold NaN or +inf; check the model's weights and dtype")
        return n_acc, [r[1:] for r in result]
