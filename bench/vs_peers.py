"""funcshard against what a torchrun user would pick instead: the Llama train step on 2 or 4 gloo processes.

Each case runs one funcshard step and its torch peer on the same processes, from the same weights:

- ``dp``: mesh ``{"dp": procs}`` vs ``DistributedDataParallel``;
- ``fsdp``: mesh ``{"fsdp": procs}`` (``Config()``: remat none, reshard after forward: each layer's weights
  gathered again for its backward, since stop 16) vs FSDP2 ``fully_shard`` on every block and on the root, its
  default (blocks reshard after forward);
- ``fsdp_keep``: ``Config(reshard_after_forward=False)`` (the gathered weights kept for the backward) vs FSDP2
  with ``reshard_after_forward=False``;
- ``tp``: mesh ``{"tp": procs}`` vs DTensor ``parallelize_module`` (torchtitan's plan, ``loss_parallel``);

the peers on the ``nn.Module`` twin of ``bench/_memory_peers.py``.

The funcshard step is what the train job runs: ``shard_map`` of ``llama.value_and_grad`` and AdamW's update,
donating params and moments (check_vma on). The peer step is ``loss.backward()``, ``torch.optim.AdamW.step()`` with
the same hyper-parameters, then ``zero_grad(set_to_none=True)`` (at the end, so that the peer holds no gradients
while the interleaved funcshard step runs: see the dp rows below). Before timing, the bench checks that both losses
agree at step 0 and after one AdamW step (funcshard's weights are loaded into the twin; rtol 1e-4), and prints them.
Then per repeat: ``--warmup`` steps each, then ``--steps`` steps each, A/B interleaved (the order flips every step),
each step timed from a barrier to a barrier on every rank (the max over ranks); the repeat's ratio is
median(funcshard) / median(peer). Printed per case: every repeat's ratio, their median (THE number) and spread
(min-max), the machine load (``os.getloadavg()``) before and after, and the collectives each side issues per step
(gloo calls seen by ``torch.profiler``; funcshard's also by ``fs.comm_stats``); ``--ops N``: the N torch ops whose
self CPU time differs most between the two sides' steps.

Measured on a 2-core box shared with 4-5 other engineers. Wall ratio = median over repeats (min-max); CPU =
the CPU-time ratio (every thread of every rank: steadier under load); calls = gloo calls per step funcshard /
peer; load = ``os.getloadavg()[0]`` before -> after. Losses equal at step 0 and step 1 in every case:

    size    procs case  peer        wall ratio           CPU    calls  load         steps x repeats
    13.2M   2     dp    DDP         1.102 (1.063-1.294)  1.159  13/3   1.35->1.67   5 x 3 (quiet machine)
    13.2M   2     fsdp  FSDP2       0.902 (0.870-0.929)  0.948  24/26  1.96->2.30   5 x 3 (quiet machine)
    13.2M   2     tp    DTensor TP  0.917 (0.878-0.973)  0.938  36/61  2.41->2.21   5 x 3 (quiet machine)
    13.2M   2     dp    DDP         1.064 (1.044-1.081)  1.054  13/3   1.80->1.84   4 x 3 (quiet; again)
    13.2M   2     dp    DDP         1.118 (1.047-1.202)  1.085  13/3   1.49->1.89   4 x 3 (FUNCSHARD_OVERLAP=0)
    13.2M   2     fsdp_keep  FSDP2  0.998 (0.995-1.034)  1.037  24/18  1.73->2.14   4 x 3 (reshard_after_forward=False)
    13.2M   4     fsdp  FSDP2       0.934 (0.904-1.067)  0.960  24/26  3.06->3.63   3 x 3
    13.2M   4     fsdp  FSDP2       0.709 (0.655-1.120)  0.970  24/26  13.0->11.9   4 x 3
    13.2M   2     dp    DDP         1.124 (0.835-1.481)  1.051  13/3   8.3->11.4    5 x 3
    13.2M   2     fsdp  FSDP2       0.783 (0.634-0.855)  0.978  24/26  9.4->15.7    5 x 3
    13.2M   2     tp    DTensor TP  0.950 (0.940-1.712)  0.980  36/61  11.5->6.8    3 x 3
    3.1M    2     dp    DDP         1.037 (1.008-1.066)  -      9/2    6.8->6.6     5 x 2
    3.1M    2     fsdp  FSDP2       1.013 (0.980-1.046)  -      16/14  5.8->4.7     5 x 2
    3.1M    2     tp    DTensor TP  0.928 (0.847-1.009)  -      20/33  4.6->4.8     5 x 2

The rows above are before issue #11's gradient-bucket and optimiser work. After it (PvaryBucket writes the
gradients once into a kept flat buffer that the dist backend sums in place, DDP's way; embed / norm / head in
one bucket and the loss's two sums in one all-reduce: 13 -> 10 calls; AdamW's donated update block by block,
in cache; TP's forward all-reduces in the matmul's own buffer), three launches of 5 x 3 on the same shared
box, loaded (the same session measured dp 1.039 (0.859-1.055), CPU 1.071, load 3.0->6.5 before the changes):

    size    procs case  peer        wall ratio           CPU    calls  load         steps x repeats
    13.2M   2     dp    DDP         1.116 (1.033-1.131)  1.038  10/3   11.9->11.5   5 x 3
    13.2M   2     dp    DDP         1.038 (1.037-1.087)  1.042  10/3   9.6->9.5     5 x 3
    13.2M   2     dp    DDP         1.099 (1.081-1.161)  1.046  10/3   8.2->9.7     5 x 3
    13.2M   2     tp    DTensor TP  0.917 (0.727-1.396)  0.912  36/61  11.7->12.0   5 x 3
    13.2M   2     tp    DTensor TP  0.890 (0.872-0.898)  0.909  36/61  8.7->7.8     5 x 3
    13.2M   2     tp    DTensor TP  0.906 (0.888-0.908)  0.901  36/61  11.5->8.2    5 x 3

dp stays 1.04-1.12x DDP in wall time (CPU 1.04-1.05x, was 1.05-1.16x); tp 0.89-0.92x DTensor (CPU 0.90-0.91x).

Then (this round): the stacked ``[n_layers, ...]`` layer weights' gradients are stacked back into buffers kept
from step to step (``models.stacked.unstack``: the fresh 52 MB stack per step cost ~55 ms of page faults, profile
at load 1-2); AdamW's in-place blocks 1M elements (33-34 ms a step, was 36-37; torch's 35); ``pvary`` / ``psum``
of one tensor without a tree walk; and tp's column-parallel backward issues the input gradient's all-reduce before
computing the weights' gradients (``ops.tp.ColumnParallel``: it travels during those matmuls, Megatron's
overlap; DTensor waits for it at once). Launches of 5 x 3 on the same shared box:

    size    procs case  peer        wall ratio           CPU    calls  load         steps x repeats
    13.2M   2     dp    DDP         1.048 (1.038-1.066)  1.046  10/3   2.95->2.50   5 x 3
    13.2M   2     dp    DDP         1.056 (1.030-1.060)  1.035  10/3   4.08->2.90   5 x 3
    13.2M   2     dp    DDP         1.039 (1.019-1.046)  1.035  10/3   2.90->2.36   5 x 3
    13.2M   2     dp    DDP         1.040 (1.011-1.040)  1.034  10/3   3.02->2.45   5 x 3
    13.2M   2     tp    DTensor TP  0.853 (0.851-0.863)  0.882  36/61  4.80->3.15   5 x 3
    13.2M   2     tp    DTensor TP  0.850 (0.846-0.865)  0.880  36/61  2.25->2.36   5 x 3
    13.2M   2     tp    DTensor TP  0.866 (0.859-0.890)  0.899  36/61  2.46->2.12   5 x 3
    13.2M   2     tp    DTensor TP  0.920 (0.836-0.960)  0.921  36/61  3.11->5.02   5 x 3 (steps 2x slower: load)

tp now 0.85-0.87x DTensor (CPU 0.88-0.90x) at load 2-5, 0.92x once at load 3->5: the <= 0.90 target met in 3
of 4 launches. dp 1.04-1.06x DDP (CPU 1.034-1.046x): the <= 1.00 target is NOT met. Where the dp step's extra time
is (per rank, main-thread CPU by phase, 10 interleaved steps, load 2-3): forward +16 ms over DDP's ~400 (the vma
mode and shard_map: ~10 ms of it goes with check_vma=False), backward +15-20 ms over ~840 (the Python backward
nodes, the pending all-reduces' AsyncCollectiveTensor wrap ~0.2 ms each and their views), optimiser ~0; and in
wall time the loss's all-reduce in the forward, a synchronisation point DDP does not have (~10 ms: the ranks'
skew). Tried: the loss's sum left pending through the backward (value_and_grad now seeds a pending loss with an
explicit 1; the forward sum made asynchronous by a patch of the dist backend): 10 interleaved steps at load 3-6,
1343 ms vs 1338 ms synchronous (DDP 1304): the forward shrinks and the backward grows by as much (the skew moves
to the end), so the Llama keeps its one synchronous (total, count) all-reduce.

Then (issue #11, helper A): the layers' gradient buckets are rows of one ``[n_layers, per layer]`` buffer, so each
stacked gradient is a strided view of it (``models.stacked.Unstack`` copies nothing: the 52 MB stack copy gone) and
a bucket's pending sum comes back as one pending view per gradient made from plain views (no split / view / stack
dispatched through a pending tensor: 72 per step). Per step and rank (main-thread CPU, 8 interleaved steps, load
5-7): PvaryBucket backward 19.6 -> 14.0 ms, Unstack backward 9.6 -> 1.4 ms, AdamW 38.9 -> 43.5 ms median (min 34.1
-> 35.7: the strided gradients, blocked by rows). Launches of 5 x 3 (the machine loaded by the other helpers' tests
and benches; load in the row):

    size    procs case  peer        wall ratio           CPU    calls  load         steps x repeats
    13.2M   2     dp    DDP         1.005 (1.002-1.012)  1.011  10/3   4.27->4.18   5 x 3
    13.2M   2     dp    DDP         0.969 (0.598-1.043)  0.967  10/3   4.13->11.16  5 x 3 (load rose 4 -> 11)
    13.2M   2     dp    DDP         1.210 (1.138-1.449)  1.043  10/3   24.4->31.2   5 x 3 (load 24-31: not a measure)
    13.2M   4     dp    DDP         1.028 (1.016-1.054)  1.039  10/3   9.14->8.59   5 x 3
    3.1M    2     dp    DDP         1.012 (1.009-1.074)  1.057  6/2    7.65->7.08   5 x 3

Median of the three 1.005x (the <= 1.00 target not shown: the spread under this load is wider than the gap);
the CPU ratio at load 4 was 1.011 / 0.967, against 1.034-1.046 before.

At the end of that round, the helpers stopped, on a quiet host (the lead, HEAD 8baf1b1):

    size    procs case  peer        wall ratio           CPU    calls  load         steps x repeats
    13.2M   2     dp    DDP         1.002 (0.804-1.013)  0.995  10/3   2.26->2.01   5 x 3
    13.2M   2     dp    DDP         1.001 (0.986-1.034)  0.993  10/3   1.92->2.10   5 x 3
    13.2M   2     fsdp  FSDP2       0.996 (0.977-1.012)  1.026  31/26  2.06->2.38   5 x 3
    13.2M   4     fsdp  FSDP2       1.041 (1.030-1.083)  1.065  31/26  3.38->4.27   4 x 3

dp is at DDP (1.00x wall, CPU 0.99x); fsdp at 2 processes 1.00x wall (CPU 1.03x), at 4 processes 1.04x.

The ``fsdp`` rows above up to stop 16 ran funcshard keeping the gathered weights (then the Llama's default
without remat: 11 gathers per step) against FSDP2's default, which gathers each block again for its backward.
Since the Llama reshards after forward without remat too (``ops.fsdp.reshard_after_forward``), ``fsdp`` compares
like with like (31 gloo calls per step vs FSDP2's 26): 1.037 / 1.042x (CPU 1.067 / 1.070) before and 1.045-1.049x
(CPU 1.065-1.072) after the half-way backward prefetch (2 procs, 5 x 3, load 2-3): the <= 1.00 target is NOT met
for the resharding step; ``fsdp_keep`` (both keep) was 0.998x.

Then (issue #11, helper B): a later layer's gradient reduce-scatter is waited for when the next regather is issued
(half-way through the layer's backward), not as a layer's regathered weights are first read, right after autograd
had issued it (rank 0's waits there 180-250 -> 30-80 ms a step, traced); and a prefetched bucket is waited for once
through an identity Function, so the layer's weights are plain views, not pending-collective wrappers whose every
op went through Python (643 -> 195 such dispatches a step). The box was loaded by other jobs (steps up to 3.5x
slower than quiet); before, the same session: 1.047 (1.042-1.109), CPU 1.068, load 2.5->6.3:

    size    procs case  peer        wall ratio           CPU    calls  load         steps x repeats
    13.2M   2     fsdp  FSDP2       0.937 (0.918-0.941)  1.062  31/26  9.6->8.4     5 x 3 (the wait moved only)
    13.2M   2     fsdp  FSDP2       0.945 (0.693-1.195)  1.066  31/26  12.5->9.8    5 x 3 (the wait moved only)
    13.2M   2     fsdp  FSDP2       0.983 (0.968-1.034)  1.037  31/26  8.7->13.1    5 x 3 (both)
    13.2M   4     fsdp  FSDP2       1.030 (0.995-1.052)  1.025  31/26  6.3->6.2     4 x 3 (both)
    13.2M   4     fsdp  FSDP2       0.920 (0.825-0.921)  1.031  31/26  16.1->24.0   3 x 3 (both)

Under this load the wall ratios are not the quiet machine's (the loaded rows above show FSDP2 losing more to load
than funcshard); the CPU ratio, steadier, went 1.068 -> 1.037 (2 procs; 4 procs 1.025-1.031). What is left of
funcshard's CPU over FSDP2's: the reshard scope's TorchDispatchMode (~1,180 ops a step through Python, ~40 ms a
device-step, measured by replacing it with no mode in a one-process sim step), 2 more all-gathers and
reduce-scatters (embed, norm and head in 3 buckets, FSDP2's root in one), and the last layer's regather, not
prefetched during the head's backward as FSDP2's root pre-backward does (~20-30 ms wait).

Then (issue #11, helper F, 2eccd1c): the Llama's final norm and head gathered in one bucket at the step's start
(29 calls; the embedding kept apart: in one root group with it, the head's full gradient waits for the
embedding's, +1 MiB on bench/memory.py's keep row), the last layer's regather issued as the backward reaches the
logits (``reshard_after_forward.regather_at``), and the layers' reshard scopes without the dispatch mode
(``derive=False``). A / B on the same tree (5d63569), 4 x 3 (4 procs) and 5 x 3 (2 procs):

    size    procs case  peer        wall ratio           CPU    calls  load         steps x repeats
    13.2M   4     fsdp  FSDP2       1.016 (0.944-1.045)  1.085  31/26  5.22->6.17   4 x 3 (before)
    13.2M   4     fsdp  FSDP2       0.924 (0.627-0.942)  1.011  29/26  12.0->10.8   4 x 3 (norm+head prefetched)
    13.2M   4     fsdp  FSDP2       0.982 (0.906-0.984)  1.070  29/26  12.95->11.10 4 x 3 (steps 3.5x slower)
    13.2M   4     fsdp  FSDP2       1.030 (1.006-1.037)  1.057  29/26  4.60->4.43   4 x 3
    13.2M   2     fsdp  FSDP2       0.983 (0.954-0.992)  1.002  29/26  2.31->2.18   5 x 3

2 processes 0.983x (CPU 1.002, was 0.996 / 1.026 on a quiet host); 4 processes 1.030x at load 4.6 (CPU 1.057;
was 1.041 / 1.065 quiet): the <= 1.00 target at 4 processes is NOT met on a quiet host.

At HEAD 98c16a9 (the above and the fused AdamW of helper D), three launches of 4 procs and one of 2 (quiet host):

    size    procs case  peer        wall ratio           CPU    calls  load         steps x repeats
    13.2M   4     fsdp  FSDP2       0.967 (0.931-0.979)  0.990  29/26  3.68->4.18   4 x 3
    13.2M   4     fsdp  FSDP2       1.044 (0.931-1.050)  1.068  29/26  3.66->4.07   4 x 3
    13.2M   4     fsdp  FSDP2       1.011 (1.002-1.029)  1.032  29/26  3.44->4.56   4 x 3
    13.2M   2     fsdp  FSDP2       0.955 (0.952-0.999)  0.984  29/26  2.20->2.13   5 x 3

4 processes: median 1.011x (CPU 1.032), launches 0.967-1.044 at the same load: the target not shown. Left (rank 0,
one step, ``--ops``, load 3.7): ``aten::cat`` 68 calls 111 ms vs FSDP2's 41 / 61 ms (each bucket's shards
concatenated, and the gradients' cat before each reduce-scatter, strided: wq/wk/wv/w1/w3 and embed/head shard
their inner dim), ``MmBackward0`` self 34 vs 3 ms (the Python of the saved-tensor unpack and the regather issued
inside it), ``aten::slice`` 396 vs 193 calls.

Then (issue #11, helper T: tp measured at 2 and 4 processes, no tp code changed; the tree of the moment, HEAD
5d63569 -> 9130ade; torch's fused AdamW (98c16a9) was in the tree for rows 2, 3 and 5). Launches of 5 x 3 (the
second at 4 processes: 4 x 3, one warm-up step, to stay under six minutes):

    size    procs case  peer        wall ratio           CPU    calls  load         steps x repeats
    13.2M   2     tp    DTensor TP  0.746 (0.717-0.829)  0.851  36/61  4.28->4.24   5 x 3
    13.2M   2     tp    DTensor TP  0.821 (0.811-0.830)  0.893  36/61  6.67->5.90   5 x 3
    13.2M   2     tp    DTensor TP  0.848 (0.817-0.881)  0.884  36/61  2.51->2.48   5 x 3 (quiet: 1783 / 2086 ms)
    13.2M   2     tp    DTensor TP  0.829 (0.826-0.894)  0.861  36/61  3.20->2.55   5 x 3 (2131 / 2570 ms)
    13.2M   4     tp    DTensor TP  0.831 (0.790-0.843)  0.836  36/61  5.38->10.25  5 x 3
    13.2M   4     tp    DTensor TP  0.758 (0.752-0.781)  0.800  36/61  8.57->6.11   4 x 3
    13.2M   4     tp    DTensor TP  0.752 (0.719-0.773)  0.772  36/61  3.94->4.09   4 x 3 (2784 / 3601 ms)

tp <= 0.90 in all seven launches (2 processes 0.75-0.85, 4 processes 0.75-0.83); CPU 0.85-0.89 at 2 processes (0.86-0.88
at load 2.5-3: not clearly under 0.90), 0.77-0.84 at 4. Where funcshard's tp step goes (rank 0, 2 processes, one
step under torch.profiler, load 11, self CPU 2,624 ms): aten::mm 63%, flash attention forward + backward 11%, the
forward's 17 synchronous all-reduces (16 row-parallel, the embedding's) 8.5%, 3-32 ms each: the wait for the other
rank, the transfer of 3 MB is 3-7 ms at that load; elementwise ops the rest; Python (the vma mode) ~12 ms a step
(cProfile). The backward's 17 column-parallel all-reduces are waited for 0.02 ms each: issued before the weights'
gradients (``ops.tp.ColumnParallel``), whose matmuls absorb both the transfer and the ranks' skew. Tried, not kept:

- q/k/v and gate/up as ONE column-parallel matmul (weights concatenated each step; forward and weight gradients
  bitwise equal, the input gradient at fp32 rounding): the same job, 8 interleaved steps each, load 13-18: CPU
  3,430 (separate) vs 3,446 ms (fused) a step, both ranks; wall 4,147 vs 4,103 ms: no gain (one-process microbench
  gains of 1-6 ms a layer do not show in the step);
- the row-parallel forward in 2 or 4 row chunks, each chunk's all-reduce issued while the next chunk's matmul
  computes (losses bitwise equal over 3 steps): CPU 3,172 / 3,201 / 3,145 ms, wall min 2,383 / 2,403 / 2,567 ms
  (1 / 2 / 4 chunks, load 9-13): no gain;
- SDPA's ``enable_gqa`` instead of ``repeat_interleave`` (``ops.attention``): ~1 ms a layer, dk / dv not bitwise.

What is left: the forward's synchronous all-reduces are where the ranks' skew is paid (8.5% of rank 0's step under
load); hiding it needs compute that does not depend on them, e.g. the batch in two halves interleaved through the
layers (one half's all-reduce travels while the other half computes, Domino-style): a model-level change
(``models/transformer.py``, ``llama.run_layers``), not bitwise (each weight's gradient summed from two halves).

Then (issue #11, helper D): ``fs.optim.adamw`` updates float32 CPU leaves with torch's fused AdamW kernel, one call
for all leaves (98c16a9; ``torch.optim.AdamW(fused=True)``'s numbers bit for bit, ~1 ulp from the single-tensor
path's in a fraction of the elements; losses equal DDP's at steps 0 and 1 as before). The optimiser per rank and
step (main-thread CPU, 6 interleaved steps, load 9-12): 43.9 -> 17.5 ms at 13.2M, 10.1 -> 6.0 ms at 3.1M (load 2-3).
Launches on the tree of the moment (9130ade + 98c16a9 + others' uncommitted work):

    size    procs case  peer        wall ratio           CPU    calls  load         steps x repeats
    13.2M   2     dp    DDP         1.089 (1.017-1.106)  1.050  10/3   4.13->2.62   5 x 3 (tests running niced beside)
    13.2M   2     dp    DDP         0.996 (0.983-1.010)  0.999  10/3   3.41->2.61   5 x 3
    13.2M   2     dp    DDP         0.992 (0.847-1.010)  0.979  10/3   2.13->2.56   5 x 3
    13.2M   4     dp    DDP         1.003 (0.980-1.104)  0.994  10/3   3.07->3.77   4 x 3 (was 1.028, CPU 1.039)
    3.1M    2     dp    DDP         1.129 (0.936-1.167)  1.067  6/2    3.69->3.21   5 x 3 (one launch: noise)

Median of the three 2-process launches 0.996x (CPU 0.999): the <= 0.98 target is NOT met; 4 processes 1.003x (CPU
0.994; <= 1.00 in CPU, not in wall). What is left, measured: funcshard steps that follow a DDP step fault in 2.4-11k
fresh heap pages (main-thread minor faults; before 98c16a9 8-11k), funcshard after funcshard 2-8, DDP 0 in every
order: the peer's step starts with ``zero_grad(set_to_none=True)``, so DDP's 52 MB of ``.grad`` stay allocated
through the funcshard step in between, whose activations then need pages beyond the mapped heap (glibc trims them
again at its end). At ~2 us a page here that is 5-20 ms of a 1.3-1.9 s step in 3 of each repeat's 5 timed steps; with
the peer zeroing at the end of its step instead, funcshard's faults fall to ~0 and DDP's stay 0 (the train job
never interleaves). A bench change, proposed to the lead, not made here.

The lead made it (6423cfc: the peer zeroes its gradients at the end of its step) and measured on a quiet host at the
end of the round (HEAD 6423cfc-9d092d6: fused AdamW, the fsdp Llama's norm+head bucket, last-layer regather and no
dispatch mode, the per-call cuts; nothing else running):

    params  procs case  peer        ratio (spread)       CPU    calls  load         steps
    13.2M   2     dp    DDP         1.013 (1.005-1.104)  1.023  10/3   1.28->1.86   5 x 3
    13.2M   2     dp    DDP         1.011 (1.003-1.017)  0.984  10/3   1.89->2.13   5 x 3
    13.2M   2     dp    DDP         0.985 (0.931-1.028)  0.999  10/3   2.02->1.92   5 x 3
    13.2M   2     dp    DDP         0.941 (0.933-0.970)  0.965  10/3   2.27->1.98   5 x 3
    13.2M   2     dp    DDP         1.094 (0.992-1.099)  1.048  10/3   1.94->2.33   5 x 3
    13.2M   2     fsdp  FSDP2       0.926 (0.875-0.979)  0.942  29/26  2.92->2.58   5 x 3
    13.2M   4     fsdp  FSDP2       0.995 (0.987-1.024)  1.014  29/26  3.42->4.19   4 x 3
    13.2M   4     fsdp  FSDP2       0.986 (0.936-1.015)  1.012  29/26  4.14->4.41   4 x 3
    13.2M   4     fsdp  FSDP2       1.040 (1.007-1.051)  1.066  29/26  3.17->4.16   4 x 3

dp: median of five launches 1.011x DDP (0.941-1.094; CPU 0.965-1.048): at DDP within this host's launch-to-launch
spread (+-5%), not clearly under it. fsdp: 2 processes 0.926x (CPU 0.942); 4 processes median 0.995x of three
(CPU 1.01-1.07), with helper F's three at 98c16a9 (0.967 / 1.044 / 1.011) the median of six is 1.003x.

Then (issue #11, round 20, helper F): the Llama's fsdp splits each weight's outer (row) dim (3719c83: wq/wk/wv/w1/w3
``P("pp", ("tp", "fsdp"), None)``, embed/head ``P(("tp", "fsdp"), None)``, as FSDP2's ``Shard(0)``): the gradients
reach their bucket's concatenation as views, no transpose copy first (rank 0, one step, 4 procs, loaded: copy_ 237
-> 117 ms, clone 22 -> 2 ms, cat 140 -> 77 ms; FSDP2 251 / 1 / 81 ms); ``fsdp_gather``'s per-call Python 175-256 ->
35 us (a4f275a). Same-process paired A/B, new / old layout / FSDP2 interleaved (9-12 rounds): 2 procs new/old wall
0.986 (CPU 0.994, load 6 -> 3.7), 4 procs 1.004 (min 0.982, CPU 0.979, load 5.6 -> 10.4). Launches at a4f275a (with
eb47c62's pending loss sums: 30 gloo calls):

    size    procs case  peer        wall ratio           CPU    calls  load         steps x repeats
    13.2M   4     fsdp  FSDP2       1.027 (0.872-1.065)  1.062  30/26  6.33->5.23   4 x 3
    13.2M   4     fsdp  FSDP2       0.957 (0.951-1.008)  1.003  30/26  3.83->4.26   4 x 3
    13.2M   4     fsdp  FSDP2       0.965 (0.957-0.997)  1.026  30/26  9.10->7.20   4 x 3
    13.2M   2     fsdp  FSDP2       0.959 (0.818-0.992)  1.005  30/26  4.00->4.87   5 x 3

The start of the round (aa12740, the same session): 4 procs 0.964 (0.886-1.145, CPU 0.995, load 4.1 -> 5.7) / 0.896
(0.714-0.900, CPU 1.002, load 8.8 -> 10.5) / 1.026 (0.959-1.076, CPU 1.049, load 7.0 -> 5.0). 4 processes: median
0.965x (target <= 0.97 met by the median, not by every launch), CPU median 1.026 (<= 1.00 NOT met); launch to
launch +-5% at this load swamps the layout's ~1-2%, so the start's median (0.964, CPU 1.002) is not told apart.

Then (issue #11, helper D, eb47c62): ``llama.loss`` sums its token count over the data axes before the forward and
its mean after it, both pending (``lax.psum_pending``: the count waited for after the forward, the mean after the
backward), so the forward has no synchronisation point (11 gloo calls a step, was 10; gradients bitwise as before,
the loss value within 1 ulp). Same-process A/B (new / the old one-all-reduce loss / DDP interleaved, 6 x 3, 13.2M,
2 procs): load 8-18 new/old 0.991 / 0.922 / 0.833 (CPU 1.003); load 3 -> 2.4 1.001 / 1.002 / 1.009 (CPU 1.002): no
cost, a gain where the ranks' skew varies. Launches on the tree of the moment (eb47c62 + others' work), loaded host:

    params  procs case  peer        ratio (spread)       CPU    calls  load         steps
    13.2M   2     dp    DDP         0.955 (0.895-0.975)  0.980  11/3   3.54->3.04   5 x 3 (2503 / 2620 ms)
    13.2M   2     dp    DDP         1.011 (0.887-1.154)  1.007  11/3   4.48->6.50   5 x 3 (steps 4x slower: load)
    13.2M   2     dp    DDP         1.196 (0.969-1.339)  0.960  11/3   5.91->6.63   5 x 3 (steps 4x slower: load)

Median 1.011x (CPU 0.960-1.007): under this load the wall spread (0.89-1.34 within a launch) is wider than the gap;
the <= 0.98 target is not shown, 4 processes not measured this round.

Then (issue #11, round 21, helper D): the Python of the dp step cut where the numbers cannot move (each bitwise,
tested sim and dist): RoPE's cos/sin tables kept per shape (8e684b7) and handed out tagged as x (4f344eb: no mixed
constant-vs-varying product in the vma mode), AdamW's in-place update with torch functions off when its leaves carry
one tag (2136b01), the optimiser's leaf paths only for an error (144ba2d), ``Unstack`` by the C ``apply`` (f5f774d),
pending gradient views waited for below the wait op's Python autograd kernel (1d75a60), q/k/v as plain views
(348cc72), and ``rms_norm`` / ``rope`` / ``_swiglu`` as one vma op each (helper V's ``one_op``). Load-independent,
rank 0, one dp=2 step of the 13.2M Llama (``sys.setprofile``; torch.profiler): Python calls 10,825 -> 4,814 (DDP
1,246), calls through the vma mode 1,705 -> 477, C calls 24,376 -> 12,577, aten ops 7,035 -> 6,371 (DDP 7,568); part
of it is helper V's vma-mode work (c75e197) in the same tree. Launches on a host loaded by the other helpers' tests
and benches (steps 3-4x slower than quiet):

    params  procs case  peer        ratio (spread)       CPU    calls  load         steps
    13.2M   2     dp    DDP         1.027 (0.900-1.175)  0.984  11/3   7.48->5.60   15 x 3 (144ba2d: 5349 / 5760 ms)
    13.2M   2     dp    DDP         0.986 (0.940-1.036)  0.993  11/3   6.29->11.46  15 x 3 (1d75a60: 4797 / 4864 ms)
    13.2M   4     fsdp  FSDP2       0.780 (0.684-0.957)  0.990  30/26  12.5->15.2   4 x 3 (cc064a2: 3148 / 4025 ms)

A same-process A/B of the first two changes (rope tables + quiet AdamW toggled, 12 rotating rounds with DDP, load
11.7 -> 8.2): new/old wall 0.962 (min 1.013), CPU 1.022: at this load the timing cannot see a ~1% change; the counts
are the evidence. The <= 1.00 targets are not shown by these loaded launches (dp CPU 0.984 / 0.993, fsdp 4 procs
CPU 0.990); a quiet-host launch is owed.

Then (issue #11, round 22, helper D): where the dp rank's time goes against DDP's (13.2M, 2 procs, rank 0, A/B
interleaved in one process pair). Callgrind of one whole step was not reached: under valgrind one uninstrumented
warm-up step took > 4 CPU-minutes at load 8-16 (kept for a quiet host). torch.profiler, 6 interleaved steps each,
median self CPU per op, load 8 (steps ~3x the quiet 1.65 s), funcshard / DDP ms:

    matmul (aten::mm)    3266 / 3337     optimiser            36 / 83  (fused AdamW vs the single-tensor path)
    attention (flash)     605 / 597     other aten ops       316 / 403  (mul, add, div, sum: AdamW's and DDP's)
    copies (cat, copy_)    52 / 46      autograd + Python     49 / 81   (Accumulate, reducer hooks)
    allocation              5 / 12      comm: waits         114 / 10   (wait_tensor 60, the synchronous last sum 52)

Main-thread CPU per step (no profiler, 10 interleaved steps, load 7-10): 1550 / 1550 ms; minor faults funcshard
0-4,227 a step (5 of 10 steps over 400), DDP 0. So funcshard's rank computes no more than DDP's (less in the
optimiser, the same matmuls and attention); what it has more is BLOCKING: the backward waited at the stacked
layers' gradient (``Unstack``) for the first layer's bucket, issued just before, then again in the last bucket's
synchronous sum, where DDP's reducer waits once after the whole backward; under load each block costs a wake-up.
Changed (df14fb5): ``Unstack`` hands the layers' pending sums back as one pending strided view per stacked leaf
(the wait is ``fs.value_and_grad``'s, after the backward: the embedding's gradient and the last bucket go on
meanwhile); same numbers (tests/models/test_unstack_hands_back_pending.py). Also: the dist backend's synchronous
in-place sum
without the generator context manager (d9d04ef, helper C's callgrind), AdamW's quiet path per leaf (bc3a0f9: tp's
update off the vma mode, helper V's count). Bucket sizes: the per-layer buckets (6.3 MB, one per layer, 9 + the
loss's 2 sums = 11 calls) are under DDP's 25 MiB cap, so the cap does not bind here; DDP's 3 buckets (1 MiB
first, then 25 MiB) overlap less. Same-process A/B, new / old Unstack / DDP rotating (12 rounds each): wall new/old
0.888 (min 2396 / 3038 ms, load 9.1 -> 4.9) and 1.077 (min 2995 / 3939 ms, load 5.6): the load's noise is wider
than the change. One launch, on a host loaded by the other helpers (the other two launches of 15 and 6 steps did
not finish inside 7 minutes at this load):

    params  procs case  peer        ratio (spread)       CPU    calls  load         steps
    13.2M   2     dp    DDP         0.884 (0.860-1.049)  1.008  11/3   11.57->5.95  4 x 3 (df14fb5: 4379 / 4701 ms)

Not shown: dp <= 1.00 in EVERY launch (a quiet host is needed to tell ~1%); fsdp was not changed this round (the
lead's quiet launches: 2 procs 0.929, 4 procs 0.940).

Usage:
    python bench/vs_peers.py --size small --procs 2 --steps 3 --repeats 1       # 1-2 min on a quiet host
    python bench/vs_peers.py --size large --procs 2 --cases dp,fsdp,tp
    python bench/vs_peers.py --size large --procs 4 --cases fsdp
    FUNCSHARD_OVERLAP=0 python bench/vs_peers.py ...                              # overlap off
    python bench/vs_peers.py --profile fsdp                                       # cProfile of rank 0's funcshard steps
    torchrun --nproc-per-node 2 bench/vs_peers.py --procs 2
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import _memory_peers as peers
import _peers_twin as twin
import torch
import torch.distributed as dist
from _launch import launch

import funcshard as fs
from funcshard import P
from funcshard.models import llama

CASES = ("dp", "fsdp", "fsdp_keep", "tp")
MESH_AXIS = {"dp": "dp", "fsdp": "fsdp", "fsdp_keep": "fsdp", "tp": "tp"}
PEER = {"dp": "DDP", "fsdp": "FSDP2", "fsdp_keep": "FSDP2(keep)", "tp": "DTensor TP"}
# --size -> (dim, layers, heads, kv heads, ffn, seq, global batch): the train job's 3.3M Llama, issue #10's 13.2M
SIZES = {"small": (256, 4, 8, 4, 704, 128, 16), "large": (384, 8, 8, 4, 1024, 256, 8)}
LR = 1e-3


def _config(size: str) -> llama.Config:
    dim, layers, heads, kv, ffn, seq, _ = SIZES[size]
    return llama.Config(
        vocab_size=256, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn, max_seq_len=seq
    )


class Side:
    """One side of a case: ``step()`` takes one train step on the fixed batch and returns its (global) loss
    as a float when ``read`` is set (a collective: every rank calls it)."""

    def __init__(self, name: str, step: Callable[[bool], float | None]) -> None:
        self.name, self.step = name, step


def _funcshard(case: str, cfg: llama.Config, tokens: torch.Tensor, targets: torch.Tensor, args: Any) -> Side:
    mesh = fs.make_mesh({MESH_AXIS[case]: args.procs}, backend="dist")
    if case == "fsdp_keep":  # the gathered weights kept for the backward, as the peer's reshard_after_forward=False
        cfg = dataclasses.replace(cfg, reshard_after_forward=False)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    opt = fs.optim.adamw(LR)
    sspecs = opt.state_specs(specs)
    params = fs.device_put(llama.init(fs.random.key(0), cfg), mesh, specs)
    state = fs.shard_map(opt.init, mesh=mesh, in_specs=(specs,), out_specs=sspecs)(params)
    x, y = (fs.device_put(t, mesh, bs) for t in (tokens, targets))

    def body(p: Any, s: Any, t: torch.Tensor, u: torch.Tensor) -> tuple[Any, Any, Any]:
        loss, grads = llama.value_and_grad(p, t, u, cfg)
        p, s = opt.update(grads, s, p)
        return loss, p, s

    compile_opt = {"backend": args.compile} if args.compile else False
    train = fs.shard_map(
        body,
        mesh=mesh,
        in_specs=(specs, sspecs, bs, bs),
        out_specs=(P(), specs, sspecs),
        donate=(0, 1),
        compile=compile_opt,
    )
    box = [params, state]

    def step(read: bool) -> float | None:
        loss, box[0], box[1] = train(box[0], box[1], x, y)
        return float(fs.device_get(loss)) if read else None

    return Side("funcshard", step)


def _peer(case: str, cfg: llama.Config, tokens: torch.Tensor, targets: torch.Tensor, args: Any) -> Side:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = twin.load_params(peers.build(cfg), llama.init(fs.random.key(0), cfg))
    if case == "tp":
        from torch.distributed.tensor.parallel import loss_parallel

        model = twin.tp_parallelize(model, world)
        local = (tokens, targets)  # every rank sees the whole batch
    else:
        per = tokens.shape[0] // world
        local = (tokens[rank * per : (rank + 1) * per], targets[rank * per : (rank + 1) * per])
        if case == "dp":
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            kw = {"reshard_after_forward": False} if case == "fsdp_keep" else {}
            for block in model.layers:
                fully_shard(block, **kw)
            fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def step(read: bool) -> float | None:
        if case == "tp":
            with loss_parallel():
                loss = twin.tp_loss(model, *local)
                loss.backward()
        else:
            loss = peers.module_loss(model, *local)
            loss.backward()
        opt.step()
        # zeroed at the end of the step (HF Trainer's order; the same arithmetic as zeroing first): the peer holds no
        # gradients while funcshard's step runs in between, which would make that step fault in fresh heap pages
        opt.zero_grad(set_to_none=True)
        if not read:
            return None
        value = loss.detach()
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        if case != "tp":  # each rank's loss is over its own (equal-sized) slice: the global mean is their mean
            value = value.clone()
            dist.all_reduce(value)
            value /= world
        return float(value)

    return Side(PEER[case], step)


def _timed(side: Side) -> tuple[float, float]:
    """One step from a barrier to a barrier: (the max over ranks of its wall seconds, the sum over ranks of the
    CPU seconds the processes used in it, every thread: compute, Python and gloo's)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    side.step(False)
    c1 = time.process_time()
    dist.barrier()
    wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    cpu = torch.tensor([c1 - c0], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return float(wall), float(cpu)


def _profiled(side: Side) -> tuple[Counter[str], dict[str, tuple[int, float]]]:
    """One step of ``side`` under torch.profiler on this rank: the gloo collectives it issues (``gloo:*``
    events), and per torch op its (calls, self CPU ms), every thread."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        side.step(False)
    calls = Counter(e.name.removeprefix("gloo:") for e in prof.events() if e.name.startswith("gloo:"))
    ops = {a.key: (a.count, a.self_cpu_time_total / 1e3) for a in prof.key_averages()}
    return calls, ops


def _op_diff(a: dict[str, tuple[int, float]], b: dict[str, tuple[int, float]], top: int) -> str:
    """The ``top`` ops whose self CPU time differs most between ``a`` (funcshard) and ``b`` (the peer)."""
    keys = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, (0, 0.0))[1] - b.get(k, (0, 0.0))[1]))
    lines = [f"  {'op':<44} {'fs calls':>8} {'fs ms':>8} {'peer calls':>10} {'peer ms':>8}"]
    for k in keys[:top]:
        (ca, ta), (cb, tb) = a.get(k, (0, 0.0)), b.get(k, (0, 0.0))
        lines.append(f"  {k[:44]:<44} {ca:>8} {ta:>8.1f} {cb:>10} {tb:>8.1f}")
    tot_a, tot_b = sum(t for _, t in a.values()), sum(t for _, t in b.values())
    lines.append(f"  {'total self CPU (this rank, one step)':<44} {'':>8} {tot_a:>8.1f} {'':>10} {tot_b:>8.1f}")
    return "\n".join(lines)


def _fmt_calls(c: Counter[str]) -> str:
    return f"{sum(c.values())} (" + ", ".join(f"{k} {v}" for k, v in sorted(c.items())) + ")"


def _case(case: str, args: Any, out: list[dict[str, Any]]) -> None:
    lead = dist.get_rank() == 0
    cfg = _config(args.size)
    seq, batch = SIZES[args.size][5], SIZES[args.size][6]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (batch, seq), generator=g)
    targets = tokens.roll(-1, dims=1)
    fs_side = _funcshard(case, cfg, tokens, targets, args)
    peer_side = _peer(case, cfg, tokens, targets, args)
    sides = (fs_side, peer_side)

    # -- the same numbers: loss at step 0 (before any update) and at step 1 (after one AdamW step)
    losses = [[s.step(True) for _ in range(2)] for s in sides]
    ok = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses[0], losses[1], strict=True))
    if lead:
        print(
            f"[{case}] losses step0 / step1: funcshard {losses[0][0]:.6f} / {losses[0][1]:.6f}, "
            f"{peer_side.name} {losses[1][0]:.6f} / {losses[1][1]:.6f}: {'equal (rtol 1e-4)' if ok else 'DIFFER'}",
            flush=True,
        )
    if not ok:
        raise SystemExit(f"[{case}] funcshard and {peer_side.name} disagree: {losses}")

    # -- the collectives per step
    prof = [_profiled(s) for s in sides]
    calls = [c for c, _ in prof]
    with fs.comm_stats() as stats:
        fs_side.step(False)
    if lead:
        both = f"funcshard {_fmt_calls(calls[0])}; {peer_side.name} {_fmt_calls(calls[1])}"
        print(f"[{case}] gloo calls per step: {both}")
        print(f"[{case}] fs.comm_stats of one step:\n{stats.table()}", flush=True)
        if args.ops:
            print(f"[{case}] torch ops, rank 0, one step each:\n{_op_diff(prof[0][1], prof[1][1], args.ops)}")

    if args.profile == case:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            fs_side.step(False)
        prof.disable()
        if lead:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            print(f"[{case}] cProfile of rank 0, {args.steps} funcshard steps, by own time:\n{s.getvalue()[:6000]}")

    # -- timing: per repeat, warm-up, then interleaved steps (the order flips every step)
    load0 = os.getloadavg()
    ratios, meds, cpu_ratios = [], [], []
    for _ in range(args.repeats):
        for _ in range(args.warmup):
            for s in sides:
                _timed(s)
        times: list[list[float]] = [[], []]
        cpus: list[list[float]] = [[], []]
        for i in range(args.steps):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for j in order:
                wall, cpu = _timed(sides[j])
                times[j].append(wall)
                cpus[j].append(cpu)
        med = [statistics.median(t) for t in times]
        meds.append(med)
        ratios.append(med[0] / med[1])
        cpu_ratios.append(statistics.median(cpus[0]) / statistics.median(cpus[1]))
    load1 = os.getloadavg()
    row = {
        "case": case,
        "procs": args.procs,
        "size": args.size,
        "params": cfg.num_params(),
        "ratio": statistics.median(ratios),
        "spread": (min(ratios), max(ratios)),
        "cpu_ratio": statistics.median(cpu_ratios),
        "fs_ms": statistics.median(m[0] for m in meds) * 1e3,
        "peer_ms": statistics.median(m[1] for m in meds) * 1e3,
        "peer": peer_side.name,
        "load": (load0[0], load1[0]),
        "calls": (sum(calls[0].values()), sum(calls[1].values())),
    }
    out.append(row)
    if lead:
        print(
            f"[{case}] funcshard / {peer_side.name} = {row['ratio']:.3f}  (repeats: "
            + ", ".join(f"{r:.3f}" for r in ratios)
            + f"; medians {row['fs_ms']:.1f} / {row['peer_ms']:.1f} ms; CPU time ratio {row['cpu_ratio']:.3f}; "
            f"load {load0[0]:.2f} -> {load1[0]:.2f})",
            flush=True,
        )


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    out: list[dict[str, Any]] = []
    for case in args.cases:
        _case(case, args, out)
    if dist.get_rank() == 0:
        overlap = os.environ.get("FUNCSHARD_OVERLAP", "1")
        print(
            f"\n{args.size} Llama ({out[0]['params']:,} params), {args.procs} gloo procs, {args.steps} steps x "
            f"{args.repeats} repeats, FUNCSHARD_OVERLAP={overlap}, compile={args.compile or 'off'}"
        )
        head = f"{'case':<10} {'peer':<12} {'ratio':>6} {'spread':>13} {'cpu':>6} {'fs ms':>8} {'peer ms':>8}"
        print(f"{head} {'calls':>9} load")
        for r in out:
            lo, hi = r["spread"]
            print(
                f"{r['case']:<10} {r['peer']:<12} {r['ratio']:>6.3f} {lo:>6.3f}-{hi:<6.3f} {r['cpu_ratio']:>6.3f} "
                f"{r['fs_ms']:>8.1f} "
                f"{r['peer_ms']:>8.1f} {r['calls'][0]:>4}/{r['calls'][1]:<4} {r['load'][0]:.2f}->{r['load'][1]:.2f}"
            )
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--procs", type=int, choices=(2, 4), default=2)
    ap.add_argument("--cases", default="dp,fsdp,tp", help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per side and repeat (the median is taken)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--compile", default="", help="a torch.compile backend for funcshard's step (default: eager)")
    ap.add_argument("--profile", default="", help="a case: cProfile rank 0's funcshard steps of it")
    ap.add_argument("--ops", type=int, default=0, help="print the N torch ops whose CPU time differs most per case")
    args = ap.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in args.cases if c not in CASES]
    if bad:
        raise SystemExit(f"--cases: unknown {bad}; use some of {', '.join(CASES)}")
    launch(run, args, world=args.procs, timeout_s=600)


if __name__ == "__main__":
    main()
