"""One peer-read call's plan as phases between its fences (:func:`phases`): the plan's
operations as this rank's device runs them, copies gathered into copy kernels and
folds into fold kernels where they can be, made once per plan and rank."""

from ..schedule import Copy, Fence, Reduce, ReduceMany

_COPY, _REDUCE, _REDUCE_MANY, _COPY_MANY, _FOLD_TO_ALL, _FOLD_BLOCKS, _COPY_KERNELS = 0, 1, 2, 3, 4, 5, 6
_MAX_COPIES = 16  # destinations a copy kernel writes (kernels/collectives.cu's copy_n)


def _overlap(a, b, apart=False):
    """Whether slice specs ``a`` and ``b`` may share memory: this rank's ``in`` and
    ``out`` may (in place, or a row of the result as the input), and so may a peer's
    (``reg``, ``rout``), unless the plan's outputs are ``apart`` from their inputs
    (``Plan.outputs_apart``); a peer's window slot only itself."""
    if a[0] != b[0] or a[1] != b[1]:
        if apart:
            return False
        if a[1] == b[1] and {a[0], b[0]} == {"reg", "rout"}:
            return True
        return a[0] in ("in", "out") and b[0] in ("in", "out")
    return a[2] < b[3] and b[2] < a[3]


def _gathered(entries, apart=False):
    """``entries`` (a phase) with every run of two or more copies that do not touch each
    other's memory (no destination overlaps another copy's source or destination) made
    one ``_COPY_MANY`` entry: one kernel, not one copy each (allgather's reads of the
    peers, two_shot's copies out of the slots)."""
    made, run = [], []

    def touches(pair, others):
        dst, src = pair
        return any(_overlap(dst, d, apart) or _overlap(dst, s, apart) or _overlap(src, d, apart) for d, s in others)

    def close():
        if len(run) > 1:
            made.append((_COPY_MANY, tuple(run)))
        else:
            made.extend((_COPY, pair) for pair in run)
        run.clear()

    for kind, specs in entries:
        if kind == _COPY and not touches(specs, run):
            run.append(specs)
            continue
        close()
        if kind == _COPY:
            run.append(specs)
        else:
            made.append((kind, specs))
    close()
    return made


def _folded_to_all(entries):
    """``entries`` (a phase, gathered) with a fold followed by copies of its result (the
    leader's into every rank's output) made one ``_FOLD_TO_ALL`` entry ``(outputs,
    inputs)``: one kernel writes the fold into every output. Only where no copy's
    destination shares memory with the fold's inputs other than their very elements (in
    place: a peer's output is its input), which the kernel reads before it writes."""
    made = []
    for kind, specs in entries:
        last = made[-1] if made else None
        if last is not None and last[0] in (_REDUCE, _REDUCE_MANY, _FOLD_TO_ALL) and kind in (_COPY, _COPY_MANY):
            outputs, inputs = last[1] if last[0] == _FOLD_TO_ALL else ((last[1][0],), last[1][1:])
            pairs = (specs,) if kind == _COPY else specs
            apart = all(not _overlap(dst, x) or (dst[1] == x[1] and dst[2:] == x[2:]) for dst, _ in pairs
                        for x in inputs)
            if all(src == outputs[0] for _, src in pairs) and apart and len(outputs) + len(pairs) <= _MAX_COPIES \
                    and not any(_overlap(dst, out) for dst, _ in pairs for out in outputs):
                made[-1] = (_FOLD_TO_ALL, (outputs + tuple(dst for dst, _ in pairs), inputs))
                continue
        made.append((kind, specs))
    return made


def _fold_parts(entry):
    """``(outputs, inputs)`` of a fold entry of :func:`phases` (a reduction, a fold into
    several outputs, folds over blocks: their inputs' spans), None for a copy."""
    kind, specs = entry
    if kind in (_REDUCE, _REDUCE_MANY):
        return (specs[0],), specs[1:]
    if kind in (_FOLD_TO_ALL, _FOLD_BLOCKS):
        return specs[0], specs[1]
    return None


def _later_reads(made, apart):
    """``read_later(k, i, spec)``: whether a fold after entry ``i`` of phase ``k`` of
    ``made`` reads memory ``spec`` may share (:func:`_overlap`)."""
    reads = [(k, i, x) for k, phase in enumerate(made) for i, entry in enumerate(phase)
             if (parts := _fold_parts(entry)) is not None for x in parts[1]]  # in order
    return lambda k, i, spec: any(_overlap(spec, x, apart) for k2, i2, x in reads if (k2, i2) > (k, i))


def _folded_in_blocks(entries, apart, read_later):
    """``entries`` (a phase) with every run of two or more folds of the same inputs,
    each over a block of its own at the same offset in every input, into outputs that
    share no memory with any of the run's inputs or with each other, made one
    ``_FOLD_BLOCKS`` entry ``(outputs, inputs, offsets)``: one kernel, not one per fold
    (a leader's reduce_scatter, every rank's block). ``inputs``: each input's span over
    the run's blocks; ``offsets``: each block's start in it. Only folds whose outputs no
    later fold reads (``read_later(index, spec)``) join a run: they are the call's
    results, and a run divides alike (avg)."""
    made, run = [], []  # run: the folds joined so far, (entry, output, inputs)

    def joins(index, dst, inputs):
        if read_later(index, dst) or len(run) >= _MAX_COPIES:
            return False
        if not run:
            return True
        first = run[0][2]
        if len(inputs) != len(first) or any(x[:2] != y[:2] for x, y in zip(inputs, first)):
            return False
        shift = inputs[0][2] - first[0][2]
        if any(x[2] - y[2] != shift for x, y in zip(inputs, first)):
            return False
        outputs = [dst] + [o for _, o, _ in run]
        reads = list(inputs) + [x for _, _, xs in run for x in xs]
        return not any(_overlap(o, x, apart) for o in outputs for x in reads) and \
            not any(_overlap(a, b, apart) for n, a in enumerate(outputs) for b in outputs[n + 1:])

    def close():
        if len(run) > 1:
            spans = tuple((x[0], x[1], min(xs[i][2] for _, _, xs in run), max(xs[i][3] for _, _, xs in run))
                          for i, x in enumerate(run[0][2]))
            offsets = tuple(xs[0][2] - spans[0][2] for _, _, xs in run)
            made.append((_FOLD_BLOCKS, (tuple(o for _, o, _ in run), spans, offsets)))
        else:
            made.extend(entry for entry, _, _ in run)
        run.clear()

    for index, entry in enumerate(entries):
        if entry[0] not in (_REDUCE, _REDUCE_MANY):
            close()
            made.append(entry)
            continue
        (dst,), inputs = _fold_parts(entry)
        if not joins(index, dst, inputs):
            close()
        if joins(index, dst, inputs):
            run.append((entry, dst, inputs))
        else:
            made.append(entry)
    close()
    return made


def _copy_kernels(pairs):
    """The ``copy_n`` kernels of a run of copies (a ``_COPY_MANY`` entry's pairs), each
    ``(destinations, sources)``: where every source has as many destinations, m (a
    leader writing each input into m ranks' outputs), each source is read once into all
    of its, 16 // m sources a kernel; else a pair each, 16 a kernel."""
    fans = {}
    for dst, src in pairs:
        fans.setdefault(src, []).append(dst)
    widths = {len(dsts) for dsts in fans.values()}
    if len(widths) == 1 and (m := widths.pop()) <= _MAX_COPIES:
        rows, per = list(fans.items()), _MAX_COPIES // m
        return tuple((tuple(d for _, dsts in rows[at : at + per] for d in dsts),
                      tuple(src for src, _ in rows[at : at + per])) for at in range(0, len(rows), per))
    return tuple((tuple(d for d, _ in pairs[at : at + _MAX_COPIES]), tuple(s for _, s in pairs[at : at + _MAX_COPIES]))
                 for at in range(0, len(pairs), _MAX_COPIES))


def _outputs_written(made):
    """The other ranks whose outputs ``made`` (:func:`phases`) writes."""
    written = set()
    for phase in made:
        for entry in phase:
            kind, specs = entry
            outputs = (specs[0],) if kind == _COPY else tuple(dst for dst, _ in specs) if kind == _COPY_MANY else \
                _fold_parts(entry)[0]
            written.update(o[1] for o in outputs if o[0] == "rout")
    return frozenset(written)


def _final_folds(made, apart):
    """``{(phase, entry)}`` of the folds in ``made`` (:func:`phases`) that write an
    output (this rank's or, on a leader, another's) which no later fold reads: the
    call's results, where avg's division goes when the fold divides. ``apart``: the
    plan's outputs share no memory with its inputs (:func:`_overlap`)."""
    read_later = _later_reads(made, apart)
    return {(k, i) for k, phase in enumerate(made) for i, entry in enumerate(phase)
            if (parts := _fold_parts(entry)) is not None and parts[0][0][0] in ("out", "rout")
            and not any(read_later(k, i, o) for o in parts[0])}


def phases(plan, rank, stride, slot):
    """``plan``'s operations in phases between its fences (kept beside the plan): each
    an ``(kind, slices)`` list, a slice ``(buffer, peer, lo, hi)`` with ``reg``,
    ``rout`` and ``shm`` slices made into a peer's input or output (``peer`` >= 0;
    ``stride`` elements per rank) or window slot (``slot`` elements per rank),
    ``lo``/``hi`` within it."""
    return phases_and_facts(plan, rank, stride, slot)[0]


def phases_and_facts(plan, rank, stride, slot):
    """``(phases, written, final)``: :func:`phases`, the other ranks whose outputs they
    write (:func:`_outputs_written`) and their final folds (:func:`_final_folds`), made
    once per plan and rank (kept beside the plan: a call looks them up)."""
    key = ("_peer_phases", rank, stride, slot)
    found = plan.__dict__.get(key[0])
    if found is not None and found[0] == key:
        return found[1]

    def spec(s):
        if s.buf == "reg":
            q = s.lo // stride
            buf = "in" if q == rank else "reg"
            return (buf, q, s.lo - q * stride, s.hi - q * stride)
        if s.buf == "shm":
            q = s.lo // slot
            return ("shm", q, s.lo - q * slot, s.hi - q * slot)
        if s.buf == "rout":  # (laid out by the plan's own stride)
            q = s.lo // plan.rout_stride
            lo, hi = s.lo - q * plan.rout_stride, s.hi - q * plan.rout_stride
            return ("out", -1, lo, hi) if q == rank else ("rout", q, lo, hi)
        return (s.buf, -1, s.lo, s.hi)

    made = [[]]
    for op in plan.ops:
        if isinstance(op, Fence):
            made.append([])
        elif isinstance(op, Copy):
            made[-1].append((_COPY, (spec(op.dst), spec(op.src))))
        elif isinstance(op, Reduce):
            made[-1].append((_REDUCE, (spec(op.dst), spec(op.a), spec(op.b))))
        elif isinstance(op, ReduceMany):
            made[-1].append((_REDUCE_MANY, (spec(op.dst),) + tuple(spec(x) for x in op.srcs)))
        else:
            raise ValueError(f"the peer-read executor cannot run {op!r}")
    apart = plan.outputs_apart
    made = [_gathered(phase, apart) for phase in made]
    later = _later_reads(made, apart)
    made = [_folded_to_all(_folded_in_blocks(phase, apart, lambda i, dst, k=k: later(k, i, dst)))
            for k, phase in enumerate(made)]
    written, final = _outputs_written(made), _final_folds(made, apart)
    made = [[(_COPY_KERNELS, _copy_kernels(specs)) if kind == _COPY_MANY else (kind, specs) for kind, specs in phase]
            for phase in made]  # (the same places: final's indices hold)
    facts = (made, written, final)
    object.__setattr__(plan, key[0], (key, facts))  # the plan is frozen; a cache beside it
    return facts
