"""The suffix tries against a brute-force count of windows, and the ``suffix`` drafter around them."""

from __future__ import annotations

import doctest
import math
import random
import threading

import pytest

import specdraft.drafters.common.suffix as suffix_module
from specdraft.drafters.common.suffix import SharedSuffix, SuffixStream, SuffixTrie

VOCAB = 4


# -- brute force ----------------------------------------------------------------------------------
def brute_counts(sequences, path):
    """(occurrences, continued occurrences) of the window ``path`` in ``sequences``."""
    n = len(path)
    if n == 0:  # the root: every position
        total = sum(len(s) for s in sequences)
        return total, total
    occ = cont = 0
    for s in sequences:
        for i in range(len(s) - n + 1):
            if list(s[i:i + n]) == list(path):
                occ += 1
                cont += i + n < len(s)
    return occ, cont


def brute_windows(sequences, max_depth):
    """Every window of 1..max_depth tokens -> occurrences."""
    out: dict[tuple, int] = {}
    for s in sequences:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + max_depth) + 1):
                out[tuple(s[i:j])] = out.get(tuple(s[i:j]), 0) + 1
    return out


def brute_match(sequences, context, max_depth):
    best = 0
    for m in range(1, min(len(context), max_depth - 1) + 1):
        if brute_counts(sequences, context[len(context) - m:])[1] > 0:
            best = m
    return best


def trie_windows(trie: SuffixTrie):
    """The trie's nodes as window -> (count, out), checking each node's ``out`` on the way."""
    found = {}
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        children = node.children or {}
        assert node.out == sum(c.count for c in children.values())
        assert children or node.children is None
        for token, child in children.items():
            assert child.count > 0, "a node with count 0 was kept"
            found[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return found


def random_stream(rng, n, vocab=VOCAB):
    return [rng.randrange(vocab) for _ in range(n)]


def assert_trie_is(trie, sequences):
    expected = brute_windows(sequences, trie.max_depth)
    assert trie_windows(trie) == expected
    assert trie.size == len(expected) + 1
    assert trie.root.count == sum(len(s) for s in sequences)


# -- the structure --------------------------------------------------------------------------------
def test_docstring_examples():
    result = doctest.testmod(suffix_module)
    assert result.attempted >= 8 and result.failed == 0


@pytest.mark.parametrize("seed", range(6))
def test_stream_matches_brute_force_as_it_grows(seed):
    rng = random.Random(seed)
    depth = rng.choice([2, 3, 5, 8])
    tokens = random_stream(rng, 60, vocab=rng.choice([2, 3, 4]))
    stream = SuffixStream(depth)
    for n, token in enumerate(tokens, 1):
        stream.append(token)
        if n % 7 == 0 or n == len(tokens):
            assert_trie_is(stream.trie, [tokens[:n]])
    for _ in range(40):  # random contexts: longest match and the continuation counts
        context = random_stream(rng, rng.randrange(1, 12))
        m = stream.trie.longest_match(context)
        assert m == brute_match([tokens], context, depth)
        for length in range(0, min(len(context), depth - 1) + 1):
            path = context[len(context) - length:]
            assert stream.trie.counts(path) == brute_counts([tokens], path)
            node = stream.trie.find(path)
            for x in range(VOCAB):
                got = node.child(x).count if node is not None and node.child(x) else 0
                assert got == brute_counts([tokens], path + [x])[0]


@pytest.mark.parametrize("seed", range(5))
def test_add_and_remove_match_brute_force(seed):
    rng = random.Random(100 + seed)
    trie = SuffixTrie(rng.choice([2, 4, 6]))
    sequences = [random_stream(rng, rng.randrange(0, 30)) for _ in range(6)]
    for s in sequences:
        trie.add(s)
    assert_trie_is(trie, sequences)
    for i in rng.sample(range(6), 4):  # remove in any order
        trie.add(sequences[i], sign=-1)
        sequences[i] = []
        assert_trie_is(trie, sequences)
    for s in sequences:
        trie.add(s, sign=-1)
    assert trie.size == 1 and trie.root.children is None and trie.root.count == 0


@pytest.mark.parametrize("seed", range(5))
def test_shared_eviction_keeps_the_newest_sequences_within_the_bound(seed):
    rng = random.Random(200 + seed)
    bound = rng.choice([10, 25, 40])
    shared = SharedSuffix(max_depth=5, max_tokens=bound)
    added = []
    for _ in range(15):
        s = random_stream(rng, rng.randrange(1, 30))
        shared.add(s)
        added.append(s[-bound:])
        kept, total = [], 0  # the newest sequences whose total fits the bound
        for seq in reversed(added):
            if total + len(seq) > bound:
                break
            kept.insert(0, seq)
            total += len(seq)
        assert list(shared.sequences) == kept and shared.tokens == total <= bound
        assert_trie_is(shared.trie, kept)
        context = random_stream(rng, 6)
        assert shared.trie.longest_match(context) == brute_match(kept, context, 5)


def _paths(nodes):
    """Each node's path (tokens from the root's child to it)."""
    paths = []
    for parent, token in nodes:
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return paths


@pytest.mark.parametrize("seed", range(8))
def test_trees_are_valid_and_best_first(seed):
    rng = random.Random(300 + seed)
    depth = 8
    tokens = random_stream(rng, 200, vocab=3)
    trie = SuffixTrie(depth)
    trie.add(tokens)
    for _ in range(20):
        context = random_stream(rng, 10, vocab=3)
        k, budget = rng.randrange(1, 6), rng.randrange(1, 20)
        alpha, width = rng.choice([0.5, 1.0, 2.0]), rng.choice([1, 2, 3])
        nodes, score = trie.draft(context, k, budget, width, alpha)
        m = trie.longest_match(context)
        max_level = min(k, max(1, math.ceil(alpha * m)))
        a = max(1, min(m, depth - max_level))
        anchor = list(context[len(context) - a:])
        assert len(nodes) <= budget
        paths = _paths(nodes)
        assert len(set(paths)) == len(paths)  # siblings are distinct
        for i, ((parent, _), path) in enumerate(zip(nodes, paths)):
            assert -1 <= parent < i
            assert len(path) <= max_level
            assert brute_counts([tokens], anchor + list(path))[0] > 0  # a real continuation
        for parent in {p for p, _ in nodes}:
            assert sum(p == parent for p, _ in nodes) <= width

        def prob(path):
            p = 1.0
            for i in range(len(path)):
                parent = brute_counts([tokens], anchor + list(path[:i]))[1]
                p *= brute_counts([tokens], anchor + list(path[: i + 1]))[0] / parent
            return p

        assert score == pytest.approx(sum(prob(p) for p in paths))
        # the first chain: each node's first child is its most frequent continuation
        node, path = -1, ()
        while True:
            first = next((i for i, (p, _) in enumerate(nodes) if p == node), None)
            if first is None:
                break
            counts = {x: brute_counts([tokens], anchor + list(path) + [x])[0] for x in range(3)}
            best = max(counts.values())
            assert counts[nodes[first][1]] == best
            node, path = first, paths[first]
        if width >= 3 and m > 0:  # no width limit: the budget most probable paths, exactly
            every = []
            frontier = [()]
            while frontier:
                path = frontier.pop()
                for x in range(3):
                    if len(path) < max_level and brute_counts([tokens], anchor + list(path) + [x])[0]:
                        every.append(prob(path + (x,)))
                        frontier.append(path + (x,))
            top = sorted(every, reverse=True)[:budget]
            assert sorted((prob(p) for p in paths), reverse=True) == pytest.approx(top)


def test_adaptive_depth_and_min_match():
    trie = SuffixTrie(24)
    trie.add(list(range(20)))
    assert trie.draft([0], k=10, budget=10, width=1, alpha=2.0)[0] == [(-1, 1), (0, 2)]  # 2 x match of 1
    assert len(trie.draft([3, 4, 5, 6], k=10, budget=10, width=1, alpha=2.0)[0]) == 8
    assert len(trie.draft([3, 4, 5, 6], k=5, budget=10, width=1, alpha=2.0)[0]) == 5  # k caps it
    assert trie.draft([0], k=10, budget=10, width=1, alpha=2.0, min_match=2)[0] == []
    assert trie.draft([99], k=10, budget=10, width=1, alpha=2.0)[0] == []


def test_min_prob_prunes_rare_continuations():
    trie = SuffixTrie(6)
    trie.add([1, 2] * 9 + [1, 3])  # after 1: 2 nine times, 3 once
    nodes, _ = trie.draft([1], k=1, budget=5, width=3, alpha=1.0)
    assert [t for _, t in nodes] == [2, 3]
    nodes, _ = trie.draft([1], k=1, budget=5, width=3, alpha=1.0, min_prob=0.2)
    assert [t for _, t in nodes] == [2]


def test_shared_structure_is_thread_safe():
    shared = SharedSuffix(max_depth=6, max_tokens=300)
    errors = []

    def work(seed):
        rng = random.Random(seed)
        try:
            for _ in range(60):
                if rng.random() < 0.5:
                    shared.add(random_stream(rng, rng.randrange(1, 40)))
                else:
                    nodes, _ = shared.draft(random_stream(rng, 5), 4, 8, 2, 2.0)
                    assert len(nodes) <= 8
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert shared.tokens == sum(map(len, shared.sequences)) <= 300
    assert_trie_is(shared.trie, list(shared.sequences))


# -- the drafter ----------------------------------------------------------------------------------
def _ctx(tokens, prompt_length, seq_id=0, tree_budget=1):
    from specdraft.types import DraftContext

    return DraftContext(token_ids=[tokens], prompt_lengths=[prompt_length], active=[True], vocab_size=64,
                        device="cpu", sampling=None, seq_ids=[seq_id], tree_budget=tree_budget)


def _drafter(model, **options):
    from specdraft import SpeculativeDecoder

    return SpeculativeDecoder(model, None, drafter="suffix", spec_length=4, drafter_options=options).drafter


def test_drafter_catches_up_incrementally(tiny_model):
    drafter = _drafter(tiny_model, scope="request", tree_budget=1)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    drafter.on_join(0, prompt)
    tokens = list(prompt)
    assert drafter.propose(_ctx(tokens, 8), 4).token_ids.shape == (1, 0)  # 8 was never continued
    tokens += [1, 2]
    draft = drafter.propose(_ctx(tokens, 8), 4)
    assert draft.parents is None and draft.token_ids.tolist() == [[3, 4, 5, 6]]  # match "1 2": 4 deep
    assert drafter._seqs[0][0].tokens == tokens
    fresh = SuffixStream(drafter.options.max_depth, tokens)
    assert trie_windows(fresh.trie) == trie_windows(drafter._seqs[0][0].trie)
    tree = drafter.propose(_ctx(tokens, 8, tree_budget=4), 4)
    assert tree.parents.tolist() == [[-1, 0, 1, 2]] and tree.token_ids.tolist() == [[3, 4, 5, 6]]


def test_shared_scope_drafts_an_earlier_requests_output(tiny_model):
    output = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    proposals = {}
    for scope in ("shared", "request"):
        drafter = _drafter(tiny_model, scope=scope, tree_budget=1)
        drafter.on_join(1, [1, 2, 3])
        ctx = _ctx([1, 2, 3] + output, 3, seq_id=1)
        drafter.on_verified(ctx, [0])  # its output, seen after a verify pass
        drafter.on_leave(1)
        drafter.on_join(2, [7, 8, 9, 10])  # another prompt, whose output starts the same
        proposals[scope] = drafter.propose(_ctx([7, 8, 9, 10, 40, 41], 4, seq_id=2), 4).token_ids.tolist()
    assert proposals == {"shared": [[42, 43, 44, 45]], "request": [[]]}
    drafter = _drafter(tiny_model)
    assert drafter.shared is not None and drafter.options.scope == "shared"  # the default


def test_shared_scope_accepts_more_on_a_repeated_request(tiny_model):
    from specdraft import SpeculativeDecoder

    prompt = [3, 17, 29, 5, 11]
    accepted = {}
    for scope in ("shared", "request"):
        dec = SpeculativeDecoder(tiny_model, None, drafter="suffix", spec_length=4, adaptive=False,
                                 drafter_options={"scope": scope})  # a fixed K: no choice made from timings
        first = dec.generate_ids([prompt], max_new_tokens=32)[0]
        second = dec.generate_ids([prompt], max_new_tokens=32)[0]
        assert second.token_ids == first.token_ids
        accepted[scope] = second.stats.accepted_tokens
    assert accepted["shared"] > accepted["request"], accepted


def test_options_are_checked(tiny_model):
    from specdraft.errors import ConfigError

    with pytest.raises((ConfigError, ValueError)):
        _drafter(tiny_model, scope="global")
    with pytest.raises((ConfigError, ValueError)):
        _drafter(tiny_model, max_depth=1)


@pytest.mark.parametrize("options", [{"scope": "request", "tree_budget": 1}, {"tree_budget": 4, "tree_width": 3}])
def test_conforms(tiny_model, options):
    from specdraft.testing import check_drafter

    check_drafter("suffix", tiny_model, drafter_options=options, samples=0)
