"""Overhead of ``shard_map`` over hand-written torch.distributed code: a tensor-parallel MLP step on 2 gloo processes.

The step (Megatron's tensor-parallel MLP, forward + backward):

    x  [batch, d]   replicated                 (requires grad, as the output of an earlier layer would)
    w1 [h, d]       column-parallel P("tp", None)
    w2 [d, h]       row-parallel    P(None, "tp")
    out  = psum_tp(gelu(x @ w1_local.T) @ w2_local.T)           # [b, d]
    loss = mean(out ** 2);  grads of (x, w1, w2)

Five variants, measured in the same job, interleaved step by step (the order rotates every iteration):

    (a) manual : torch.distributed + two ``torch.autograd.Function``s (Megatron's f and g: identity forward /
                 all-reduce backward on the input of the column-parallel layer, all-reduce forward / identity
                 backward on the output of the row-parallel layer)
    (b) fs     : ``fs.shard_map(check_vma=False)`` with ``fs.pvary`` + ``fs.psum``, ``torch.autograd.grad`` inside
    (c) fs+vma : ``fs.shard_map(check_vma=True)``, the same body without the hand-written ``fs.pvary``
    (d) vag    : the step as the README teaches it: ``fs.value_and_grad(loss_fn, argnums=(0, 1, 2))`` inside
                 ``fs.shard_map(check_vma=False)`` (``fs.pvary`` written), ``x`` passed as a plain full tensor
                 each call, ``w1`` / ``w2`` as the ``fs.Array``s a training loop keeps, ``fs.Array``s out
    (e) vag+vma: the same with ``check_vma=True`` (no ``fs.pvary`` written)

All five make the same two all-reduces of a [batch, d] tensor per step, on the same three blocks (one storage
each: a matmul's speed here depends on where its operands lie, +-5% between two copies of one block). The script
checks that they agree with each other and with the unsharded model before timing, then prints the median time
per step and the ratios to (a), and the communication of one funcshard step as counted by ``fs.comm_stats()``.

Measured (torch 2.13 CPU, 2 gloo processes on a 2-core host shared with 3 other jobs; ratios to (a), median
wall clock (CPU of the calling thread); "before" = main at 2361aa9, "now" = this round's code; before and now
alternate launch by launch, 3 launches each per size, and 2 more launches of now at the end of the round
(small); small with --steps 300, large with the default 100):

    small (--batch 8 --d 128 --h 512)   before (3, load 1.8-3.9)    now (5, load 1.8-4.2)       target
      (b) shard_map, vma off            1.16-1.26x (CPU 1.40-1.43)  1.02-1.15x (CPU 1.26-1.29)  1.05
      (c) shard_map, vma on             1.16-1.30x (CPU 1.51-1.55)  1.01-1.25x (CPU 1.39-1.43)  1.25
      (d) value_and_grad, vma off       1.14-1.29x (CPU 1.57-1.58)  0.97-1.24x (CPU 1.35-1.38)  1.10
      (e) value_and_grad, vma on        1.17-1.32x (CPU 1.66-1.70)  0.95-1.24x (CPU 1.43-1.45)  1.25
    large (defaults: 64 x 512 x 2048)   before (load 1.4-5.0)       now (load 2.2-7.8)
      (b) shard_map, vma off            0.99-1.05x (CPU 1.07-1.08)  1.01-1.04x (CPU 1.04-1.06)  1.05
      (c) shard_map, vma on             1.04-1.05x (CPU 1.08)       1.03-1.04x (CPU 1.06-1.07)  1.25
      (d) value_and_grad, vma off       1.02-1.07x (CPU 1.09-1.10)  0.92-1.06x (CPU 1.06-1.07)  1.03
      (e) value_and_grad, vma on        1.05-1.08x (CPU 1.10-1.11)  1.04-1.06x (CPU 1.06-1.08)  1.03

Targets against those numbers: by the wall-clock medians the (a)-relative targets are met in 2 of 5 launches
for (d) small (1.01, 0.97; the others 1.14, 1.24, 1.18), all 5 for (e) small, 2 of 3 for (d) large, none for
(e) large (1.04-1.06). They are NOT met on CPU time, the steadier measure here: the hand-written step spends
0.73-0.95 ms of CPU at the small size and its wall median is 2.6-4.7 ms, i.e. the wall clock is mostly waiting
for the other process to be scheduled on this busy host, which hides (or, when (a) is scheduled promptly,
shows) the library's CPU. What funcshard still spends per step, one process (``tp`` of
size 1, no peer to wait for), main-thread CPU over (a) at the small size, before -> now (A/B, load 2.4-3.0):
(b) +284-303 -> +179-191 us, (d) +385-403 -> +254-256 us, (e) +463-485 -> +312 us; at the large size (d)
+562 us (3.2%, part of it the psum's copy of its operand into a fresh 128 KiB buffer).

What changed this round: shard_map flattens its arguments once per call and caches per call signature
everything it fixes (tree structures, specs, layouts, resharding plans, how each leaf's blocks are found, the
vma tags), and assembles one device's outputs without the cross-device comparisons; ``fs.value_and_grad``
runs the autograd engine itself (no ``torch.autograd.grad`` argument handling, no dispatch through the vma
mode; the backward still runs with the mode off the stack); a psum's backward returns the cotangent itself
when no graph is recorded (no ``Pvary`` Function: its transpose is the identity there); the vma mode widens
an invariant constant (no grad, no tangent) by a tagged view instead of a ``Pvary`` Function (67 of the 84
per device in the tp=2 Llama step) and makes operands agree without a pytree walk; axis names checked once
per mesh. ``tests/whitebox/autodiff/test_value_and_grad_runs_engine.py`` and
``tests/whitebox/shard_map/test_call_plans_made_once.py`` count each of these. What is left,
~15-40 us each: the lazy copy-on-write clone of each input block, the tags set and cleared per call, the
``fs.Array`` per output, the collectives' layers (``lax``, the Function, the dist backend's copy of the
operand into a fresh buffer: (a) sums in place), value_and_grad's leaf copies and graph walk, and per op ~2 us
for any torch function mode plus ~1.7 us for the vma mode's handler.

Issue #11's per-op / per-call round (A/B: main at 0f746b8 "before" and this code "now" alternating launch by
launch, 3 launches each, small size, --steps 300, load 4.2-7.5 at launch; median of the launches' ratios to (a),
range in brackets):

    small, CPU / (a)                    before                  now                     wall / (a), before -> now
      (b) shard_map, vma off            1.319 (1.293-1.357)     1.276 (1.269-1.312)     1.03-1.16 -> 1.14-1.20
      (c) shard_map, vma on             1.413 (1.395-1.448)     1.397 (1.392-1.430)     1.15-1.27 -> 1.16-1.35
      (d) value_and_grad, vma off       1.362 (1.357-1.402)     1.341 (1.313-1.347)     0.95-1.22 -> 1.06-1.20
      (e) value_and_grad, vma on        1.439 (1.382-1.465)     1.388 (1.386-1.421)     1.12-1.24 -> 1.13-1.20

The wall targets: (d) <= 1.10 met in 1 of 3 launches before and now, (e) <= 1.25 in 3 of 3 both; on CPU none
(the CPU ratios moved by 0.02-0.05, less than one launch's spread at this load). A load-independent count
instead of a clock: Python bytecodes executed per step over (a) (``sys.settrace`` with opcode events; one
process, tp of size 1, so no peer): (b) +3098 -> +2742, (c) +5039 -> +4649, (d) +5207 -> +4533, (e) +6272 ->
+5569 (-11 to -13%). What changed: the vma mode hands metadata reads (``x.shape``, ``x.dim()``, ``x.size(i)``)
straight to torch, passes an invariant constant that meets a varying operand as it is (no tagged view), and
tags results inline; ``fs.value_and_grad(f)`` is a small callable object (``functools.wraps`` cost more than
the rest of making it: the README's step makes one per call) whose leaf copies and gradients are tagged
without calls; shard_map keeps its executor, its name and (dist) the device context across calls, clones the
argument blocks under one hold of the lock, and rebuilds no tree around a one-leaf argument. What is left, by
bytecodes per (d) step: value_and_grad's graph walk (~680: the closed-over-leaf check and the last node, one
Python step per edge of the graph) and its leaf handling (~620), assembling the 4 output Arrays (~320), the
collectives' layers (``lax``, ``_prims.call``, the dist backend: ~500), argument preparation (~400).

Issue #11, round 3 (8e4a4a7, 9130ade, 6bb6ba5; A/B: the library at 5d63569 "before" and this round's "now",
alternating launch by launch, 3 launches each, both with this file (whose (d) / (e) now get compact param
blocks like (a)-(c): w2's block of P(None, "tp") was a strided view), small size, --steps 300, load 2.5-12 at
launch; median of the launches' ratios to (a), range in brackets):

    small, CPU / (a)                    before                  now                     wall / (a), before -> now
      (b) shard_map, vma off            1.280 (1.264-1.286)     1.230 (1.207-1.251)     1.03-1.08 -> 1.00-1.20
      (c) shard_map, vma on             1.387 (1.370-1.427)     1.398 (1.331-1.425)     1.12-1.24 -> 0.98-1.28
      (d) value_and_grad, vma off       1.296 (1.291-1.337)     1.301 (1.264-1.324)     1.02-1.08 -> 1.00-1.24
      (e) value_and_grad, vma on        1.361 (1.355-1.422)     1.351 (1.325-1.416)     1.06-1.11 -> 1.05-1.27

    large (defaults), one launch each   before (load 2.3)       now (load 3.2)
      (b) shard_map, vma off            1.009x (CPU 1.056)      0.997x (CPU 1.064)          target 1.05
      (c) shard_map, vma on             1.060x (CPU 1.092)      1.073x (CPU 1.065)          1.25
      (d) value_and_grad, vma off       1.052x (CPU 1.085)      1.029x (CPU 1.052)          1.03
      (e) value_and_grad, vma on        1.028x (CPU 1.080)      1.003x (CPU 1.058)          1.03

(the large launches ran at different moments of a shared host: (a) took 10.1 ms of CPU in before's, 7.4 in
now's; now met both large targets in its launch, (d) 1.029 and (e) 1.003, before (e) only.)

Wall targets in these launches: (d) <= 1.10 in 3 of 3 before and 1 of 3 now, (e) <= 1.25 in 3 of 3 and 2 of 3,
(b) <= 1.05 in 1 of 3 both: a launch's wall ratio is set by how promptly the peer process is scheduled on this
host (the lowest-load launch of now met all four targets, 1.00 / 0.98 / 1.00 / 1.05), and the CPU ratios move
by less than one launch's spread. What the change saves, measured without the other process's noise: the same
process runs each variant with the functions of 5d63569 patched in and with this round's, alternating step by step
(tp of size 1; paired medians of 600 steps, two runs, load 15): (b) -46 / -47 us a step, (c) -15 / -20, (d) -34 /
-38, (e) -32 / -27, and at load 2.8 -28, -17, -33, -22 ((a) ~1 ms CPU there). What changed: the argument tuple and a
``(loss, grads)`` output are flattened without optree (its C flatten costs ~2.5 us for a tuple of three tensors;
``flatten`` gives optree's very leaves and structure, keyed by the tuple's flat shape), the call-signature key holds
no Mesh (its hash is a Python call) and ``axes_of`` is keyed by the mesh object, ``fs.value_and_grad`` switches grad
mode only when it is off (~2 us), ``FUNCSHARD_AUDIT`` is read from ``os.environ``'s own mapping (its ``get`` of an
unset variable raises and catches a KeyError: 1-2 us a call) and the vma mode pushes and pops torch's mode stack
itself. What is left, measured by patching one piece out (same process): the psum's fresh
result buffer (dist backend: a clone of the operand, then gloo on new memory; summing in place saves 31 us a
step small and ~155 us large, in a patch that is not safe as it stands: asked of the backend's owner), the
copy-on-write clone of each input block (~15 us), the graph walk (~10 us, and needed: without the last node
known the backward's last reduction goes asynchronous, +117 us), each op's dispatch through the vma mode, the
collectives' layers. Tried without gain: the graph walk breadth first with C iterators (682 -> 290 bytecodes but
9 -> 15 us: a set per level of this chain-like graph costs more than the Python steps) and depth first over a
node set (no change); bytecode counts mislead here (the Python ``flatten`` executes more bytecodes than optree's
C call and is twice as fast).

Issue #11, round 4 (c17b9bf: ``fs.value_and_grad`` checks its argnums once per argnums object, hands single-tensor
arguments over without pytree structures, and its graph walk checks a leaf's node where it meets it). A clock-free
count: the instructions the calling thread executes per step (valgrind's callgrind, instrumentation on for 50 steps
after 10 of warmup, one process, tp of size 1; two runs agree to 0.003%), aa12740 -> c17b9bf:

    instructions a step                 aa12740                 c17b9bf                 over (a)
      (a) hand-written                  2,146,381               (the same)
      (d) value_and_grad, vma off       2,634,715 (1.228x)      2,617,982 (1.220x)      +488k -> +472k (-3.4%)
      (e) value_and_grad, vma on        2,753,443 (1.283x)      2,736,141 (1.275x)      +607k -> +590k (-2.9%)

Where (d)'s +488k instructions over (a) go (callgrind by C function): CPython's own work, i.e. Python glue:
the eval loop 127k, object allocation and freeing, dict and attribute lookups, frames (~110 more Python calls and
~4,600 more bytecodes than (a)); torch's C work beyond (a) (lazy clones, detaches, node wrappers) is ~10% of it.
Same-process paired A/B, each piece patched out (upper bounds, load 2.7-3.4): the graph walk 46 us a step (its
Python steps and the Python objects it makes of the fresh graph's nodes), assembling the 4 output Arrays 32 us;
clear_vma, _finish, the plain-autograd check and the differentiability check each under the ~10 us noise of such a
pair. The change is ~0.8% of (a), below a launch's spread (CPU/(a) moves by 0.05-0.1 between launches at load 2-10
on this shared host), so the bench's launches cannot show it; the CPU targets stay NOT met: counted in
instructions, (d) <= 1.10 needs 257k of its 472k over (a) gone and (e) <= 1.25 another 53k, and the bench's CPU
ratios (2 processes) run above these instruction ratios. The graph walk cannot be skipped soundly: a closed-over
leaf that requires grad (a global nn.Parameter, a tensor made inside f) is seen only in the graph, and a
per-function cache of that answer would be wrong once what f reads changes.

Launches, aa12740 and c17b9bf alternating, 3 each, small, --steps 300, this bench file for both, load 2.3-10.0 at
launch (the lock shared with other jobs' runs); median of the launches' ratios to (a), range in brackets:

    small, CPU / (a)                    aa12740                 c17b9bf                 wall / (a), before -> now
      (b) shard_map, vma off            1.288 (1.211-1.289)     1.288 (1.265-1.307)     1.07-1.16 -> 1.09-1.13
      (c) shard_map, vma on             1.467 (1.368-1.474)     1.427 (1.385-1.431)     1.13-1.27 -> 1.08-1.18
      (d) value_and_grad, vma off       1.351 (1.266-1.368)     1.302 (1.284-1.342)     1.18-1.27 -> 1.03-1.16
      (e) value_and_grad, vma on        1.432 (1.357-1.437)     1.404 (1.385-1.422)     1.03-1.25 -> 1.07-1.21

(b) and (c) run the same code in both columns: their 0.00-0.04 moves are the launches' noise, as large as (d)'s and
(e)'s. Wall targets: (d) <= 1.10 in 0 of 3 before, 1 of 3 now (1.025); (e) <= 1.25 in 3 of 3 both.

Issue #11, round 5 (helper C: 7946d45, c7644c5, c7783db, 8fe383a). The count is round 4's, made with
``valgrind --tool=callgrind --collect-atstart=no --toggle-collect=functools_reduce`` around ``functools.reduce`` over
50 steps after 10 of warmup (one process, a dist mesh ``{"tp": 1}``, the variants built as here), each on a clean
worktree: instructions of the calling thread a step, 1740484 (the start of the round) -> 8fe383a:

    instructions a step                 1740484                 8fe383a                 over (a)
      (a) hand-written                  2,146,668               2,145,727
      (d) value_and_grad, vma off       2,614,126 (1.218x)      2,498,211 (1.164x)      +467k -> +352k (-25%)
      (e) value_and_grad, vma on        2,731,106 (1.272x)      2,618,665 (1.220x)      +584k -> +473k (-19%)

    (d) by commit (the shared working tree, others' uncommitted changes in: within 0.1% of the clean counts):
    7946d45 2,520,857 (-92k), c7644c5 2,500,889 (-20k), c7783db 2,498,861, 8fe383a 2,496,948.
    Targets counted in instructions: (e) <= 1.25 met; (d) <= 1.10 NOT met (<= 2,360,300: another ~138k).

What changed (7946d45, the bulk): a ``pvary``'s backward that is not differentiated (grad mode off, no torch.func
transform, no forward-AD level) sums by calling ``AllReduce.forward`` itself, with no Function applied (no context
object, no ``setup_context``, no C++ ``apply``); ``_prims.call`` keeps each class's bound C++ ``apply`` (no ``super``
object a call); ``lax.psum`` of one tensor makes no closure; under ``"dist"`` a call that reshards and donates nothing
runs from the arguments' flat leaves (``_executor.run_local``: each leaf's block, its copy-on-write clone and its tag
in one pass, without the ``Inputs`` lists and the ``DeviceBody.own`` / ``run`` layers); an Array argument's spec is
keyed by its object (a ``P``'s hash is a Python call), kept alive by the signature. Then (c7644c5) ``graph_walk``
asks only the sink nodes their sequence number and never stacks a leaf's node (a micro count: 60k -> 50k
instructions a walk of this graph, the same answer), and smaller trims. Python bytecodes a (d) step: 5398 -> 4615.

Where (d)'s remaining ~+350k go (callgrind by C function, against (a)): the eval loop and object churn of ~4,400 more
bytecodes (``graph_walk`` ~580 of them, ~50k instructions with the node wrappers ``next_functions`` makes and frees
for every node; ``value_and_grad``'s leaf copies and checks ~650; shard_map's key, blocks and 4 output Arrays ~900);
the vma tags (each tagged tensor gets its own ``__dict__``: ``free_keys_object`` + ``dict_dealloc`` ~+60k a step, asked
of ``_vma.py``'s owner); the psum's copy of its operand (``THPVariable_clone`` ~10k a call; (a) sums in place, and
the dist backend's in-place path goes through ``dist.all_reduce``'s Python wrapper: asked of its owner); thread-local
reads (``local_getattro`` +15k). No sound shortcut for the graph walk was found: a closed-over leaf that requires grad
is seen only in the graph, and torch exposes no C++ walk of it (``torch._C._autograd._get_sequence_nr`` gives the
thread's counter, not the graph's nodes).

Launches, 1740484 ("before", a clean worktree) and the shared working tree at 8fe383a ("now": other helpers'
uncommitted changes to ``_vma.py`` included) alternating, 3 each, small, --steps 300, this bench file for both, load
6.9-11.2 at launch (2 cores shared with 3 other jobs); median of the launches' ratios to (a), range in brackets:

    small, CPU / (a)                    before                  now                     wall / (a), before -> now
      (b) shard_map, vma off            1.272 (1.232-1.331)     1.207 (1.206-1.216)     1.07-1.21 -> 0.97-1.11
      (c) shard_map, vma on             1.416 (1.401-1.465)     1.367 (1.363-1.374)     1.24-1.27 -> 1.08-1.29
      (d) value_and_grad, vma off       1.293 (1.286-1.361)     1.247 (1.238-1.279)     1.12-1.20 -> 1.16-1.22
      (e) value_and_grad, vma on        1.416 (1.351-1.440)     1.346 (1.322-1.351)     1.23-1.32 -> 1.12-1.29

Wall targets at this load: (d) <= 1.10 in 0 of 3 before and now; (e) <= 1.25 in 1 of 3 before, 2 of 3 now. The large
size was not launched this round (the shared timing lock was held by other jobs' runs for most of it).

Issue #11, round 6 (helper C: d8d922c, a0c1845). The lead's launch on a quiet host (20:56, before this round): small
wall (d)/(a) 0.964 and 1.065, (e) 1.018 and 1.084 (targets met), but CPU (d)/(a) 1.19-1.24, (e) 1.27-1.30: the wall
ratios pass because (a) waits for its peer. Round 5's callgrind count (``--toggle-collect=functools_reduce``, 50
steps after 10 of warmup, one process, a dist mesh ``{"tp": 1}``), each root a clean worktree of f3ea3a8 (with and
without this round's diff), all variants of a root in one process:

    instructions a step                 f3ea3a8                 this round              over (a)
      (a) hand-written                  2,148,002               2,147,640
      (d) value_and_grad, vma off       2,493,069 (1.161x)      2,476,645 (1.153x)      +345k -> +329k (-4.7%)
      (e) value_and_grad, vma on        2,603,745 (1.212x)      2,586,379 (1.204x)      +456k -> +439k (-3.7%)

Aims were (d) <= 1.08x, (e) <= 1.12x: NOT met; the targets of the issue, counted in instructions, stay unmet for
(d) small (<= 1.10x). What changed: ``fs.value_and_grad``'s plain autograd path keeps its per-call state in locals
(no ``_GradCall`` object, no ``_GradOn`` context object), ``graph_walk`` keeps its nodes in a set (no ``id`` a node,
no comprehension frames), ``run_local`` makes its lazy clones without a frame a leaf, and ``fs.psum`` of a temporary
of at least ``lax.INPLACE_MIN_BYTES`` (16 KiB) sums it in its own buffer under dist, as (a) does: a tensor whose
only Python reference is ``psum``'s own (``sys.getrefcount``, calibrated at import; off on 3.14+), whose C++ tensor
nothing else holds (``_use_count``: not saved as a backward's input) and whose storage nothing else holds (no view,
no saved output, no copy-on-write clone). ``tests/collectives/test_psum_temporary_in_place.py`` fails under dist
without each
check. Measured per psum of a temporary (callgrind, dist shard_map): 4 KiB +2.5k instructions in place (so the
small step, whose psum is 4 KiB, keeps the copy), 128 KiB -11.9k (the large step's), besides the copy's page
faults. In the whole small step, in place cost +10.5k over the copy (2,483,031 vs 2,472,547, same process): the
dist backend's in-place path entered a generator context manager (``_waiting``) that its copying path did not
(d9d04ef removed it; measured again on top of it: 4 KiB +3.4k in place, 16 KiB +0.9k, so the 16 KiB floor
stays). Same-process timing of the large step, in place vs copy alternating (tp of size 1, load 5-8): paired
medians -7 / +67 / +98 us, inside the noise of a 20 ms CPU step on this host.

What is left of (d)'s +329k over (a) (callgrind by C function): Python glue spread over ~100 more Python calls
a step than (a) (shard_map's key, blocks, context, 4 output Arrays; value_and_grad's checks and leaf copies; the
collectives' layers through ``lax``, ``_prims`` and the backend; the Overlap scope; each ~0.5-3k instructions)
and the graph walk's node objects (``THPCppFunction`` made and freed per node: ~40k with ``Node`` refcounting).

How sure a launch is. The wall ratio of one launch moves by about +-5% at 100 steps on this host (two 100-step
launches of the large size gave (d) 0.996 and 1.081, (e) 0.986 and 1.056), so the table now also prints a 95%
interval of each wall ratio (a paired bootstrap over the rounds, each round every variant once, back to back) and
a verdict per target: met (the interval below it), NOT met (above it) or undecided; the default is 400 steps (the
interval narrows as 1/sqrt(steps)). One launch at the large size, 400 steps, load 0.3: (b) 1.038 [0.993-1.074],
(c) 1.041 [0.992-1.082], (d) 1.033 [0.996-1.069], (e) 1.052 [1.023-1.086]; CPU / (a) 1.03-1.06. What is behind the
large-size gap, counted rather than timed: callgrind, one process, tp of size 1, 20 steps: (a) 103.59M
instructions a step, (d) 103.94M (1.0033x), (e) 104.05M (1.0044x); at tp=2 the profiler shows the matmuls' self
time equal and every variant waiting ~4.6 ms a step in the all-reduces; page faults ~0 for all. The library's own
work at that size is ~0.4%; the rest of the measured gap is where the two processes are scheduled.

Issue #11, round 7: a one-shot all-reduce for small sums. Under ``"dist"`` a synchronous all-reduce whose
gathered copies take at most 256 KiB (``FUNCSHARD_ONE_SHOT_BYTES``) gathers every process's copy and sums them on
each process, in the group's logical order (the sim backend's order: the same bits): one ring pass instead of gloo's
reduce-scatter plus all-gather, half the wake-ups of a latency-bound sum (as NCCL picks an algorithm by size, and
torch's symmetric-memory ``one_shot_all_reduce`` does on GPUs). One sum alone (gloo, 2 processes, median wall): 1-64
KiB 480-940 -> 385-810 us; 4 processes 4.7-5.0 -> 3.5-3.8 ms; 1 MiB 1.48 -> 1.77 ms (hence the limit). Its CPU is
higher (+30-60 us a sum: the gather buffer and the adds). (a) keeps ``dist.all_reduce`` (what a hand-written step
calls), so at the small size the wall ratios now include the algorithm's gain: three launches, 1000 steps, load
1.7-2.1: (d) 0.742, 0.798, 0.835 (intervals 0.68-0.89), (e) 0.793, 0.808, 0.856, (b) 0.84-0.90; the CPU ratios
(d) 1.25, (e) 1.31-1.34 show the per-call work is unchanged. ``FUNCSHARD_ONE_SHOT_BYTES=0`` times funcshard on
gloo's ring, as (a): (d) 1.002-1.117 in the launches before this change. At the large size the [64, 512] sum
(128 KiB, 256 KiB gathered) goes one-shot too: (d) 1.008, 1.011, (e) 1.012, 1.032 (two launches, 400 steps).

Usage:
    python bench/shard_map_overhead.py            # spawns 2 gloo processes itself
    torchrun --nproc-per-node 2 bench/shard_map_overhead.py
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _launch import launch

import funcshard as fs
from funcshard import P

WORLD = 2
#: the ratio to (a) each variant should stay under, at the small (--batch 8 --d 128 --h 512) and the default size
TARGETS = {
    "small": {"fs": 1.05, "fs+vma": 1.25, "vag": 1.10, "vag+vma": 1.25},
    "large": {"fs": 1.05, "fs+vma": 1.25, "vag": 1.03, "vag+vma": 1.03},
}


# ---------------------------------------------------------------- (a) hand-written, Megatron style


class CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce backward (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)  # [b, d] -> [b, d]
        return g


class ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x)  # [b, d] -> [b, d]
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def manual_step(x, w1, w2):
    """x, w1, w2: this process's blocks (leaves that require grad)."""
    h = F.gelu(F.linear(CopyToTP.apply(x), w1))  # [b, d] @ [d, h/tp] -> [b, h/tp]
    out = ReduceFromTP.apply(F.linear(h, w2))  # [b, h/tp] @ [h/tp, d] -> [b, d], all-reduce over tp
    loss = (out**2).mean()
    grads = torch.autograd.grad(loss, (x, w1, w2))
    return loss.detach(), grads


# ---------------------------------------------------------------- (b), (c) funcshard


def fs_body(explicit_pvary: bool) -> Callable[..., Any]:
    def body(x, w1, w2):
        xin = fs.pvary(x, "tp") if explicit_pvary else x  # check_vma=True inserts this pvary itself
        h = F.gelu(F.linear(xin, w1))  # [b, d] @ [d, h/tp] -> [b, h/tp]
        out = fs.psum(F.linear(h, w2), "tp")  # [b, h/tp] @ [h/tp, d] -> [b, d], all-reduce over tp
        loss = (out**2).mean()
        grads = torch.autograd.grad(loss, (x, w1, w2))
        return loss.detach(), grads

    return body


def vag_body(explicit_pvary: bool) -> Callable[..., Any]:
    """The step written with ``fs.value_and_grad``, as the README teaches (no autograd leaves needed)."""

    def loss_fn(x, w1, w2):
        xin = fs.pvary(x, "tp") if explicit_pvary else x  # check_vma=True inserts this pvary itself
        h = F.gelu(F.linear(xin, w1))  # [b, d] @ [d, h/tp] -> [b, h/tp]
        out = fs.psum(F.linear(h, w2), "tp")  # [b, h/tp] @ [h/tp, d] -> [b, d], all-reduce over tp
        return (out**2).mean()

    def body(x, w1, w2):
        return fs.value_and_grad(loss_fn, argnums=(0, 1, 2))(x, w1, w2)

    return body


IN_SPECS = (P(), P("tp", None), P(None, "tp"))
OUT_SPECS = (P(), IN_SPECS)


def reference(x, w1, w2):
    """The unsharded model on full tensors."""
    x, w1, w2 = (t.detach().clone().requires_grad_(True) for t in (x, w1, w2))
    loss = (F.linear(F.gelu(F.linear(x, w1)), w2) ** 2).mean()
    return loss.detach(), torch.autograd.grad(loss, (x, w1, w2))


# ---------------------------------------------------------------- the job


def ratio_interval(
    times_by_rank: list[dict[str, list[float]]], base: str, resamples: int = 400, seed: int = 0
) -> dict[str, tuple[float, float]]:
    """A 95% interval of each variant's median-wall-clock ratio to ``base``, by a paired bootstrap over rounds.

    Round ``i`` ran every variant once, back to back, on every rank; a resample draws rounds with replacement and
    keeps each round whole (the variants' steps of one round share the host's load at that moment), then takes
    each variant's median per rank and the slower rank's, as the printed ratios do.

    Example:
        >>> t = [{"a": [1.0, 1.1, 0.9, 1.0], "b": [1.1, 1.2, 1.0, 1.1]}]
        >>> lo, hi = ratio_interval(t, "a")["b"]
        >>> 1.0 < lo <= hi < 1.25
        True
    """
    rng = random.Random(seed)
    names = list(times_by_rank[0])
    n = min(len(t[base]) for t in times_by_rank)
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        med = {name: max(statistics.median([t[name][i] for i in pick]) for t in times_by_rank) for name in names}
        for name in names:
            ratios[name].append(med[name] / med[base])
    out = {}
    for name, rs in ratios.items():
        rs.sort()
        out[name] = (rs[int(0.025 * (len(rs) - 1))], rs[int(0.975 * (len(rs) - 1))])
    return out


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-6):
        raise AssertionError(f"{what}: max abs difference {(a - b).abs().max().item():.3e}")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    lead = rank == 0
    mesh = fs.make_mesh({"tp": WORLD}, backend="dist")

    g = torch.Generator().manual_seed(0)  # every process builds the same full tensors
    b, d, h = args.batch, args.d, args.h
    x_full = torch.randn(b, d, generator=g)
    w1_full = torch.randn(h, d, generator=g) / d**0.5
    w2_full = torch.randn(d, h, generator=g) / h**0.5

    # Every variant computes on the same three blocks (one storage each): the matmuls' speed on this CPU depends on
    # where their operands lie (alignment, cache sets; +-5% between two copies of one block), so separate copies
    # per variant would add a per-launch bias that has nothing to do with the code around the matmuls.
    # device_put under "dist" keeps views of the full tensor (w2's block of P(None, "tp") is a strided column slice):
    # the blocks are made compact unless --view-shards asks for device_put's own.
    arrays = fs.device_put((x_full, w1_full, w2_full), mesh, IN_SPECS)
    if not args.view_shards:
        for a in arrays:
            for c, t in a.shards.items():
                a.shards[c] = t.clone(memory_format=torch.contiguous_format)
    blocks = tuple(a.local.detach() for a in arrays)
    for a in arrays:  # (b), (c): the blocks as leaves needing grad (torch.autograd.grad inside)
        for c, t in a.shards.items():
            a.shards[c] = t.detach().requires_grad_(True)
    # (a): the same storage as its own leaves (compact copies when --view-shards leaves funcshard device_put's views)
    local = tuple(
        (t.clone(memory_format=torch.contiguous_format) if args.view_shards else t.detach()).requires_grad_(True)
        for t in blocks
    )

    step_fs = fs.shard_map(fs_body(True), mesh=mesh, in_specs=IN_SPECS, out_specs=OUT_SPECS, check_vma=False)
    step_vma = fs.shard_map(fs_body(False), mesh=mesh, in_specs=IN_SPECS, out_specs=OUT_SPECS, check_vma=True)
    # (d), (e): params kept as Arrays (no autograd leaves: value_and_grad differentiates), x a plain full tensor
    params = fs.device_put((w1_full, w2_full), mesh, IN_SPECS[1:])
    if not args.view_shards:  # the same blocks (storage) as the other variants'
        for a, blk in zip(params, blocks[1:], strict=True):
            for c in a.shards:
                a.shards[c] = blk
    x_in = blocks[0]  # x is replicated: this process's block is the full x
    step_vag = fs.shard_map(vag_body(True), mesh=mesh, in_specs=IN_SPECS, out_specs=OUT_SPECS, check_vma=False)
    step_vag_vma = fs.shard_map(vag_body(False), mesh=mesh, in_specs=IN_SPECS, out_specs=OUT_SPECS, check_vma=True)
    variants: dict[str, Callable[[], Any]] = {
        "manual": lambda: manual_step(*local),
        "fs": lambda: step_fs(*arrays),
        "fs+vma": lambda: step_vma(*arrays),
        "vag": lambda: step_vag(x_in, *params),
        "vag+vma": lambda: step_vag_vma(x_in, *params),
    }
    fs_names = ("fs", "fs+vma", "vag", "vag+vma")

    # -- correctness first: the three variants agree with each other and with the unsharded model
    ref_loss, ref_grads = reference(x_full, w1_full, w2_full)
    m_loss, m_grads = variants["manual"]()
    _close(m_loss, ref_loss, "manual loss vs unsharded")
    for name in fs_names:
        loss, grads = variants[name]()
        _close(loss.local, m_loss, f"{name} loss vs manual")
        for k, gr, gm, gref in zip(("x", "w1", "w2"), grads, m_grads, ref_grads, strict=True):
            _close(gr.local, gm, f"{name} grad {k} (local block) vs manual")
            _close(fs.device_get(gr), gref, f"{name} grad {k} (gathered) vs unsharded")
    for k, gm, gref, a in zip(("x", "w1", "w2"), m_grads, ref_grads, arrays, strict=True):
        # the manual variant's block vs this process's block of the unsharded gradient
        _close(gm, fs.device_put(gref, mesh, a.spec).local, f"manual grad {k} (local block) vs unsharded")
    if lead:
        print(f"check: manual, {', '.join(fs_names)} agree (loss {m_loss.item():.6f}; unsharded {ref_loss.item():.6f})")

    # -- communication of one funcshard step
    all_stats = []
    for name in fs_names:
        with fs.comm_stats() as s:
            variants[name]()
        all_stats.append(s)
    stats = all_stats[0]
    payload = b * d * x_full.element_size()  # one [b, d] fp32 all-reduce
    for s in all_stats:
        assert s.calls("psum", "tp") == 2, s.table()  # forward psum + backward psum of the pvary on x
        assert s.bytes("psum", "tp") == 2 * payload, s.table()
        assert s.calls() == 2, s.table()

    # -- timing: warmup, then interleaved steps (the order rotates so no variant always runs first)
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}  # wall clock
    cpu: dict[str, list[float]] = {n: [] for n in names}  # CPU time of this thread (excludes waiting)
    for _ in range(args.warmup):
        for n in names:
            variants[n]()
    dist.barrier()
    for i in range(args.steps):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            c0, t0 = time.thread_time(), time.perf_counter()
            variants[n]()
            t1, c1 = time.perf_counter(), time.thread_time()
            times[n].append(t1 - t0)
            cpu[n].append(c1 - c0)
    # every rank waits for the other in the all-reduces; report the slower rank's medians
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (times, cpu))
    med = {n: max(statistics.median(t[n]) for t, _ in every) * 1e3 for n in names}
    med_cpu = {n: max(statistics.median(c[n]) for _, c in every) * 1e3 for n in names}
    interval = ratio_interval([t for t, _ in every], "manual")

    if lead:
        print()
        print(
            f"TP MLP step (fwd + bwd), tp={WORLD} gloo processes, 1 thread each; "
            f"batch {b}, d {d}, h {h}; torch {torch.__version__}"
        )
        print(f"{args.steps} interleaved steps per variant after {args.warmup} warmup; median (max over ranks)")
        if args.view_shards:
            print("funcshard inputs: device_put's shards as they are (views of the full tensors)")
        load, ncpu = args.load_before, os.cpu_count() or 1
        busy = "  (busy host: expect noisy wall-clock ratios; the cpu columns are steadier)" if load > ncpu else ""
        print(f"host: {ncpu} cpus, 1-min load average {load:.1f} at launch{busy}")
        print()
        print(
            f"{'variant':<34} {'median ms':>10} {'p10':>7} {'p90':>7} {'/ (a)':>7} {'95% interval':>13}"
            f" {'target':>8} {'cpu ms':>8} {'cpu / (a)':>9}"
        )
        print("-" * 111)
        labels = {
            "manual": "(a) torch.distributed + Functions",
            "fs": "(b) shard_map(check_vma=False)",
            "fs+vma": "(c) shard_map(check_vma=True)",
            "vag": "(d) value_and_grad, vma off",
            "vag+vma": "(e) value_and_grad, vma on",
        }
        small = (b, d, h) == (8, 128, 512)
        targets = TARGETS["small" if small else "large"] if small or (b, d, h) == (64, 512, 2048) else {}
        for n in names:
            q = statistics.quantiles(times[n], n=10)
            target = f"<= {targets[n]:.2f}" if n in targets else ""
            lo, hi = interval[n]
            print(
                f"{labels[n]:<34} {med[n]:>10.3f} {q[0] * 1e3:>7.2f} {q[-1] * 1e3:>7.2f} {med[n] / med['manual']:>7.3f}"
                f" {f'{lo:.3f}-{hi:.3f}':>13} {target:>8} {med_cpu[n]:>8.3f} {med_cpu[n] / med_cpu['manual']:>9.3f}"
            )
        verdicts = []
        for n in fs_names:
            if n in targets:
                lo, hi = interval[n]
                word = "met" if hi <= targets[n] else "NOT met" if lo > targets[n] else "undecided (widen --steps)"
                verdicts.append(f"{labels[n][:3]} {word}")
        if verdicts:
            print("targets by the 95% interval of the wall ratio: " + ";  ".join(verdicts))
        print()
        print(
            "ratios (median wall clock): "
            + "   ".join(f"{labels[n][:3]}/(a) = {med[n] / med['manual']:.3f}" for n in fs_names)
        )
        print(
            "overhead per step: "
            + ";  ".join(
                f"{labels[n][:3]} {med[n] - med['manual']:+.3f} ms wall, {med_cpu[n] - med_cpu['manual']:+.3f} ms cpu"
                for n in fs_names
            )
        )
        print("(cpu = CPU time of the calling thread, which leaves out waiting for the peer: steadier on a busy host)")
        from funcshard._src.runtime.backends import dist as dist_backend

        limit = dist_backend._ONE_SHOT_BYTES
        print(
            f"funcshard's all-reduces whose gathered copies take <= {limit:,} bytes are one-shot (gather, then sum in"
            " order); FUNCSHARD_ONE_SHOT_BYTES=0 runs gloo's ring all-reduce, as (a) does"
            if limit
            else "funcshard's all-reduces: gloo's ring all-reduce, as (a)'s (FUNCSHARD_ONE_SHOT_BYTES=0)"
        )
        print()
        print("communication of one funcshard step (rank 0; the same for every funcshard variant):")
        print(stats.table())
        print(f"expected: 2 all-reduces of [{b}, {d}] fp32 = 2 x {payload:,} bytes (the manual variant makes the same)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--h", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument(
        "--steps",
        type=int,
        default=400,
        help="timed steps per variant (>= 20; the 95%% interval of a wall ratio narrows as 1/sqrt(steps))",
    )
    ap.add_argument(
        "--view-shards",
        action="store_true",
        help="give funcshard the shards exactly as fs.device_put makes them (views of the full tensors)",
    )
    args = ap.parse_args(argv)
    if args.steps < 20:
        ap.error("--steps must be at least 20")
    args.load_before = os.getloadavg()[0]
    launch(run, args, WORLD, timeout_s=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
