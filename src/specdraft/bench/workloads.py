"""Bench workloads for drafting from what is already known (issue 30): *edits* and *repeated work*.

Both are built, deterministically (seeded), from the training data in ``../shared/data`` --
GSM8K's train split and Self-Instruct's tasks -- and never from Spec-Bench, which is what every
other figure is measured on. Rows have Spec-Bench's shape plus a ``prediction``
(``{"question_id", "category", "turns": [prompt], "prediction": str | None}``) and two fields
the bench ignores: ``reference`` (the expected answer, where there is one) and ``source``
(where the text came from).

* **edits** (``edit-number``, ``edit-word``, ``edit-typo``): a passage (a GSM8K problem with its
  worked solution, or a Self-Instruct answer of at least :data:`MIN_WORDS` words, some of them
  code) and an instruction that changes a small part of it: one number, one word, or one
  misspelling. The prompt is the instruction followed by the passage; the prediction is the
  passage as it stands in the prompt, which the rewritten answer matches except for the edit.
* **repeated work** (``repeated-gsm8k``, ``repeated-json``, ``repeated-refine``): streams of
  requests where later ones resemble earlier ones: GSM8K problems solved in one fixed answer
  format, Self-Instruct requests described as JSON objects with the same keys, and
  Self-Instruct tasks asked again with constraints added one at a time (multi-turn
  refinement, three requests a task). No prediction: what is known is the earlier answers.

* **long-prompt mix** (``long-document``, ``short-chat``): short Self-Instruct requests, and one
  in :data:`LONG_EVERY` a document of about :data:`LONG_WORDS` words (worked GSM8K problems) with
  a question about it: for ``specdraft bench-serve``, where long prompts join while short answers
  stream (chunked prefill).

* **multi-turn** (``multi-turn``): conversations of :data:`CHAT_TURNS` short Self-Instruct requests
  after one shared system prompt of about :data:`SYSTEM_WORDS` words (a tutoring service's
  instructions and worked GSM8K problems as its reference material), for ``specdraft
  bench-serve --multi-turn``: each turn resends the whole conversation (prefix caching).

* **tool calls** (``tool-call``): short Self-Instruct requests to save as a note (the function
  named) or to be reminded of (``required``), with two tools whose arguments quote the request:
  for ``specdraft bench-serve`` (rows carry ``tools`` and ``tool_choice``).

``python -m specdraft.bench.workloads --out DIR [--edits N] [--repeated N] [--long-mix N] [--multi-turn N] [--tool-calls N] [--data DIR] [--seed S]``
writes ``DIR/edits.jsonl``, ``DIR/repeated.jsonl``, ``DIR/long_mix.jsonl``, ``DIR/multi_turn.jsonl`` and ``DIR/tool_calls.jsonl``
for ``specdraft bench --questions`` and ``specdraft bench-serve --questions``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Iterable, Sequence

#: passages shorter than this many words are not used for edits
MIN_WORDS = 60
#: a changed number or word may occur at most this many times in its passage (the edit stays small)
MAX_OCCURRENCES = 3
EDIT_KINDS = ("edit-number", "edit-word", "edit-typo")
REPEATED_KINDS = ("repeated-gsm8k", "repeated-json", "repeated-refine")
#: question ids of the files do not overlap, so the files can be concatenated
EDIT_ID_BASE, REPEATED_ID_BASE, LONG_ID_BASE = 1000, 2000, 3000
#: the long-prompt mix: one row in this many is a long prompt of about this many words
LONG_EVERY, LONG_WORDS = 4, 1500
SELF_INSTRUCT_FILES = ("seed_tasks.jsonl", "user_oriented_instructions.jsonl")

_KEEP = "Do not change anything else, and reply with the rewritten text only."
#: words an ``edit-word`` instruction may swap, with what it swaps them for
WORD_SWAPS = {
    "bought": "purchased", "buys": "purchases", "sold": "traded", "sells": "trades", "total": "sum",
    "money": "cash", "friends": "classmates", "friend": "classmate", "store": "shop", "house": "home",
    "car": "truck", "week": "month", "weeks": "months", "day": "night", "days": "nights", "hours": "minutes",
    "minutes": "seconds", "dollars": "euros", "cookies": "muffins", "apples": "pears", "books": "magazines",
    "students": "pupils", "children": "kids", "people": "guests", "teacher": "coach", "school": "college",
    "large": "big", "small": "little", "quickly": "rapidly", "important": "essential", "example": "instance",
    "different": "various", "good": "great", "often": "frequently", "also": "additionally",
    "however": "nevertheless", "because": "since", "simple": "easy", "information": "details", "problem": "issue",
    "result": "outcome", "function": "routine", "value": "amount", "list": "array", "number": "count",
    "string": "text", "water": "juice", "food": "meals", "city": "town", "game": "match", "team": "squad",
    "garden": "yard",
}
_NUMBER = r"(?<![\w.,/]){}(?![\w/]|[.,]\d)"  # a whole number, not part of a word, decimal or fraction
_GSM8K_FORMAT = ("Solve the problem below. Answer in exactly this format:\n"
                 "Given: <the quantities the problem states>\n"
                 "Steps: <one line per calculation, like 48 / 2 = 24>\n"
                 "Answer: <the final number>\n\nProblem: {question}")
_JSON_FORMAT = ('Describe the request below as a JSON object with exactly these keys: "task" (a short name), '
                '"domain", "needs_input" (true or false), "output_type" ("text", "list", "code" or "number") '
                'and "difficulty" ("easy", "medium" or "hard"). Reply with the JSON object only.\n\n'
                "Request: {request}")
#: the constraints a refinement stream adds, one more per request
REFINEMENTS = ("Keep it under 100 words.", "Use a numbered list.", "Use a friendly tone.",
               "End with a one-line summary.", "Avoid jargon.", "Give one concrete example.")
REFINE_TURNS = 3


# -- data ------------------------------------------------------------------------------------------

def default_data_dir() -> Path:
    """``../shared/data`` relative to the working directory, else relative to the repository."""
    candidates = [Path.cwd() / ".." / "shared" / "data", Path(__file__).resolve().parents[3] / ".." / "shared" / "data"]
    for path in candidates:
        if path.is_dir():
            return path.resolve()
    return candidates[0]


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (expected the shared training data; see --data)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gsm8k_problems(data: Path) -> list[dict]:
    """GSM8K's train split: ``question`` and ``answer`` (the worked solution)."""
    return _jsonl(Path(data) / "gsm8k" / "train.jsonl")


def self_instruct_tasks(data: Path) -> list[dict]:
    """Self-Instruct's seed and user-oriented tasks, each with ``source`` (file and id) added."""
    tasks = []
    for name in SELF_INSTRUCT_FILES:
        for n, task in enumerate(_jsonl(Path(data) / "self_instruct" / name)):
            tasks.append({**task, "source": f"self_instruct/{name}:{task.get('id', n)}"})
    return tasks


def clean_gsm8k_answer(answer: str) -> str:
    """A worked solution as prose: calculator notes ``<<48/2=24>>`` dropped, ``#### 72`` spelled out."""
    text = re.sub(r"<<[^>]*>>", "", answer)
    return re.sub(r"\n?####\s*(.+)\s*$", lambda m: f"\nThe answer is {m.group(1).strip()}.", text).strip()


def _words(text: str) -> int:
    return len(text.split())


def edit_passages(data: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(gsm8k, self_instruct)`` lists of ``(source, passage)``: GSM8K problems with their worked
    solutions, and Self-Instruct answers, of at least :data:`MIN_WORDS` words."""
    gsm = []
    for n, p in enumerate(gsm8k_problems(data)):
        text = f"{p['question'].strip()}\n\n{clean_gsm8k_answer(p['answer'])}"
        if _words(text) >= MIN_WORDS:
            gsm.append((f"gsm8k/train.jsonl:{n}", text))
    si = [(t["source"], inst["output"].strip()) for t in self_instruct_tasks(data) for inst in t["instances"]
          if _words(inst["output"]) >= MIN_WORDS]
    return gsm, si


# -- edits -----------------------------------------------------------------------------------------

def _number_edit(text: str, rng: random.Random) -> tuple[str, str, str] | None:
    """``(instruction, prediction, reference)`` changing one number of ``text``, or None."""
    counts: dict[str, int] = {}
    for m in re.finditer(_NUMBER.format(r"\d+"), text):
        counts[m.group()] = counts.get(m.group(), 0) + 1
    # every place the digits occur is that whole number (not '4p', '3.00' or '1/2': "everywhere" is unambiguous)
    choices = sorted(n for n, c in counts.items() if c <= MAX_OCCURRENCES and len(n) <= 6
                     and c == len(re.findall(rf"(?<!\d){n}(?!\d)", text)))
    rng.shuffle(choices)
    for old in choices:
        for _ in range(10):
            new = str(max(int(old) + rng.choice((-3, -2, -1, 1, 2, 3, 4, 5, 10)), 1))
            if new != old and not re.search(_NUMBER.format(new), text):
                break
        else:
            continue
        reference = re.sub(_NUMBER.format(re.escape(old)), new, text)
        return (f"Rewrite the text below exactly as it is, but change the number {old} to {new} everywhere "
                f"it appears. {_KEEP}", text, reference)
    return None


def _word_edit(text: str, rng: random.Random) -> tuple[str, str, str] | None:
    """``(instruction, prediction, reference)`` swapping one word of ``text`` (see WORD_SWAPS), or None."""
    choices = []
    for word in sorted(WORD_SWAPS):
        exact = len(re.findall(rf"\b{word}\b", text))
        # every occurrence in lower case (no 'Each' beside 'each'), and the new word not already there
        if 0 < exact <= MAX_OCCURRENCES and exact == len(re.findall(rf"\b{word}\b", text, re.I)) \
                and not re.search(rf"\b{WORD_SWAPS[word]}\b", text, re.I):
            choices.append(word)
    if not choices:
        return None
    old = rng.choice(choices)
    new = WORD_SWAPS[old]
    reference = re.sub(rf"\b{old}\b", new, text)
    return (f"Rewrite the text below exactly as it is, but replace the word '{old}' with '{new}' everywhere "
            f"it appears. {_KEEP}", text, reference)


def _typo_edit(text: str, rng: random.Random) -> tuple[str, str, str] | None:
    """``(instruction, prediction, reference)``: one word of ``text`` misspelled (two letters
    swapped) in the prompt and the prediction; the reference is ``text`` as it was."""
    counts: dict[str, int] = {}
    for word in re.findall(r"\b[a-z]{6,}\b", text):
        counts[word] = counts.get(word, 0) + 1
    choices = sorted(w for w, c in counts.items() if c == 1 and len(re.findall(rf"\b{w}\b", text, re.I)) == 1)
    rng.shuffle(choices)
    for word in choices:
        j = rng.randrange(1, len(word) - 2)  # neither the first nor the last letter
        typo = word[:j] + word[j + 1] + word[j] + word[j + 2:]
        if typo == word or re.search(rf"\b{typo}\b", text, re.I):
            continue
        misspelled = re.sub(rf"\b{word}\b", typo, text)
        return (f"Rewrite the text below exactly as it is, but fix the misspelled word '{typo}'. {_KEEP}",
                misspelled, text)
    return None


_EDITORS = {"edit-number": _number_edit, "edit-word": _word_edit, "edit-typo": _typo_edit}


def build_edits(data: Path, n: int = 60, seed: int = 0) -> list[dict]:
    """``n`` edit rows, the kinds in turn (:data:`EDIT_KINDS`), passages alternating between
    GSM8K and Self-Instruct (two of each kind from one source, then two from the other) while
    Self-Instruct's last."""
    rng = random.Random(seed)
    gsm, si = edit_passages(data)
    rng.shuffle(gsm)
    rng.shuffle(si)
    pools = {"gsm8k": iter(gsm), "self_instruct": iter(si)}
    rows = []
    for i in range(n):
        kind = EDIT_KINDS[i % len(EDIT_KINDS)]
        order = ("self_instruct", "gsm8k") if (i // (2 * len(EDIT_KINDS))) % 2 else ("gsm8k", "self_instruct")
        row = None
        for pool in order:
            for source, passage in pools[pool]:
                made = _EDITORS[kind](passage, rng)
                if made is not None:
                    instruction, prediction, reference = made
                    row = {"question_id": EDIT_ID_BASE + i, "category": kind,
                           "turns": [f"{instruction}\n\n{prediction}"], "prediction": prediction,
                           "reference": reference, "source": source}
                    break
            if row is not None:
                break
        if row is None:
            raise ValueError(f"the data has too few passages for {n} edits (made {len(rows)})")
        rows.append(row)
    return rows


# -- repeated work ---------------------------------------------------------------------------------

def _split(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


def _request(task: dict) -> str:
    inp = task["instances"][0]["input"].strip() if task["instances"] else ""
    return f"{task['instruction'].strip()}\n\n{inp}" if inp else task["instruction"].strip()


def build_repeated(data: Path, n: int = 60, seed: int = 0) -> list[dict]:
    """``n`` rows in three streams (:data:`REPEATED_KINDS`, about a third each, each stream's rows
    consecutive): GSM8K problems in one answer format, Self-Instruct requests described as JSON
    with fixed keys, and Self-Instruct tasks refined over :data:`REFINE_TURNS` requests that add
    a constraint each."""
    rng = random.Random(seed + 1)
    n_gsm, n_json, n_refine = _split(n, 3)
    problems = gsm8k_problems(data)
    picked = rng.sample(range(len(problems)), n_gsm)
    rows: list[dict] = []

    def add(category: str, prompt: str, source: str) -> None:
        rows.append({"question_id": REPEATED_ID_BASE + len(rows), "category": category, "turns": [prompt],
                     "prediction": None, "source": source})

    for i in picked:
        add("repeated-gsm8k", _GSM8K_FORMAT.format(question=problems[i]["question"].strip()), f"gsm8k/train.jsonl:{i}")
    tasks = self_instruct_tasks(data)
    order = list(range(len(tasks)))
    rng.shuffle(order)
    json_tasks, rest = order[:n_json], order[n_json:]
    if len(json_tasks) < n_json:
        raise ValueError(f"the data has too few Self-Instruct tasks for {n_json} JSON requests")
    for i in json_tasks:
        add("repeated-json", _JSON_FORMAT.format(request=_request(tasks[i])), tasks[i]["source"])
    refine = [i for i in rest if not tasks[i].get("is_classification") and _words(_request(tasks[i])) <= 150]
    made = 0
    for i in refine:
        if made >= n_refine:
            break
        constraints = rng.sample(REFINEMENTS, REFINE_TURNS - 1)
        for turn in range(REFINE_TURNS):
            if made >= n_refine:
                break
            extra = " ".join(constraints[:turn])
            add("repeated-refine", f"{_request(tasks[i])}\n\n{extra}".rstrip() if extra else _request(tasks[i]),
                f"{tasks[i]['source']} (request {turn + 1} of {REFINE_TURNS})")
            made += 1
    if made < n_refine:
        raise ValueError(f"the data has too few Self-Instruct tasks for {n_refine} refinement requests")
    return rows


def _worked_problems(problems: list[dict], words: int, rng: random.Random) -> list[tuple[int, str]]:
    """GSM8K problems with their worked solutions, ``(index, text)``, in a random order until
    they hold ``words`` words."""
    picked, total = [], 0
    for j in rng.sample(range(len(problems)), len(problems)):
        if total >= words:
            break
        text = f"{problems[j]['question'].strip()}\n{clean_gsm8k_answer(problems[j]['answer'])}"
        picked.append((j, text))
        total += _words(text)
    return picked


def build_long_mix(data: Path, n: int = 24, seed: int = 0) -> list[dict]:
    """``n`` rows, one in :data:`LONG_EVERY` a long prompt (``long-document``: about
    :data:`LONG_WORDS` words of worked GSM8K problems, then a question about one of them) and
    the rest short Self-Instruct requests (``short-chat``): what chunked prefill is for, long
    prompts joining while short answers stream (bench-serve's gap columns)."""
    rng = random.Random(seed + 2)
    problems, tasks = gsm8k_problems(data), self_instruct_tasks(data)
    short = list({_request(t): t for t in tasks if not t.get("is_classification") and _words(_request(t)) <= 60}
                 .values())  # each request once
    rng.shuffle(short)
    rows: list[dict] = []
    for i in range(n):
        if i % LONG_EVERY == LONG_EVERY - 1:
            picked = _worked_problems(problems, LONG_WORDS, rng)
            asked = rng.randrange(len(picked))
            document = "\n\n".join(f"Problem {k + 1}. {text}" for k, (_, text) in enumerate(picked))
            prompt = (f"{document}\n\nIn one sentence: what does problem {asked + 1} above ask, and what is its "
                      "answer?")
            rows.append({"question_id": LONG_ID_BASE + i, "category": "long-document", "turns": [prompt],
                         "prediction": None, "source": "gsm8k/train.jsonl:" + ",".join(str(j) for j, _ in picked)})
        else:
            task = short.pop()
            rows.append({"question_id": LONG_ID_BASE + i, "category": "short-chat", "turns": [_request(task)],
                         "prediction": None, "source": task["source"]})
    return rows


#: words of the multi-turn workload's shared system prompt (about 1,000 tokens), and turns per conversation
SYSTEM_WORDS = 700
CHAT_TURNS = 4
MULTI_TURN_ID_BASE = 500_000


def build_multi_turn(data: Path, n: int = 8, seed: int = 0) -> list[dict]:
    """``n`` conversations (rows with ``system`` and :data:`CHAT_TURNS` ``turns``), all after the
    same system prompt: instructions and worked GSM8K problems (:data:`SYSTEM_WORDS` words), then
    short Self-Instruct requests, each used once."""
    rng = random.Random(seed + 3)
    problems, tasks = gsm8k_problems(data), self_instruct_tasks(data)
    picked = _worked_problems(problems, SYSTEM_WORDS, rng)
    system = ("You are the assistant of a tutoring service. Answer briefly and clearly; when a question is about "
              "arithmetic, show the steps the way the worked examples below do.\n\nWorked examples:\n\n"
              + "\n\n".join(f"Example {k + 1}. {text}" for k, (_, text) in enumerate(picked)))
    short = list({_request(t): t for t in tasks if not t.get("is_classification") and _words(_request(t)) <= 40}
                 .values())
    rng.shuffle(short)
    if len(short) < n * CHAT_TURNS:
        raise ValueError(f"{n} conversations of {CHAT_TURNS} turns need {n * CHAT_TURNS} short Self-Instruct "
                         f"requests; the data has {len(short)}")
    rows = []
    for i in range(n):
        turns = [short.pop() for _ in range(CHAT_TURNS)]
        rows.append({"question_id": MULTI_TURN_ID_BASE + i, "category": "multi-turn", "system": system,
                     "turns": [_request(t) for t in turns], "prediction": None,
                     "source": "gsm8k/train.jsonl:" + ",".join(str(j) for j, _ in picked) + "; "
                               + ", ".join(t["source"] for t in turns)})
    return rows


TOOL_CALL_ID_BASE = 600_000
#: the tool-call workload's tools: notes and reminders whose arguments quote the request
TOOL_SET = [
    {"type": "function", "function": {
        "name": "save_note", "description": "Save a note for the user.",
        "parameters": {"type": "object", "properties": {"title": {"type": "string"}, "text": {"type": "string"}},
                       "required": ["title", "text"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "set_reminder", "description": "Remind the user of a task at a time.",
        "parameters": {"type": "object", "properties": {"task": {"type": "string"},
                                                        "when": {"type": "string"},
                                                        "priority": {"enum": ["low", "normal", "high"]}},
                       "required": ["task", "when", "priority"], "additionalProperties": False}}},
]
WHENS = ("tomorrow at 9", "on Friday", "in two hours", "next Monday morning")


def build_tool_calls(data: Path, n: int = 16, seed: int = 0) -> list[dict]:
    """``n`` requests whose answer is a tool call (rows with :data:`TOOL_SET` and a ``tool_choice``):
    save a short Self-Instruct request as a note (the save_note function named), or be reminded
    of it (``required``: the model picks the function), each request used once. The arguments
    mostly quote the request, as agents' calls quote their input."""
    rng = random.Random(seed + 4)
    short = list({_request(t): t for t in self_instruct_tasks(data)
                  if not t.get("is_classification") and 5 <= _words(_request(t)) <= 40}.values())
    rng.shuffle(short)
    if len(short) < n:
        raise ValueError(f"{n} tool-call rows need {n} short Self-Instruct requests; the data has {len(short)}")
    rows = []
    for i, task in enumerate(short[:n]):
        text = _request(task)
        if i % 2 == 0:
            prompt = f"Save this as a note with a short title:\n\n{text}"
            choice = {"type": "function", "function": {"name": "save_note"}}
        else:
            prompt = f"Remind me {rng.choice(WHENS)} to do this:\n\n{text}"
            choice = "required"
        rows.append({"question_id": TOOL_CALL_ID_BASE + i, "category": "tool-call", "turns": [prompt],
                     "tools": TOOL_SET, "tool_choice": choice, "prediction": None, "source": task["source"]})
    return rows


# -- files -----------------------------------------------------------------------------------------

def write_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def write_workloads(out: Path, data: Path | None = None, edits: int = 60, repeated: int = 60,
                    seed: int = 0, long_mix: int = 0, multi_turn: int = 0, tool_calls: int = 0) -> list[Path]:
    """``out/edits.jsonl``, ``out/repeated.jsonl``, ``out/long_mix.jsonl``, ``out/multi_turn.jsonl``
    and ``out/tool_calls.jsonl`` (a count of 0 skips its file)."""
    data = Path(data) if data is not None else default_data_dir()
    out = Path(out)
    written = []
    if edits:
        written.append(write_jsonl(out / "edits.jsonl", build_edits(data, edits, seed)))
    if repeated:
        written.append(write_jsonl(out / "repeated.jsonl", build_repeated(data, repeated, seed)))
    if long_mix:
        written.append(write_jsonl(out / "long_mix.jsonl", build_long_mix(data, long_mix, seed)))
    if multi_turn:
        written.append(write_jsonl(out / "multi_turn.jsonl", build_multi_turn(data, multi_turn, seed)))
    if tool_calls:
        written.append(write_jsonl(out / "tool_calls.jsonl", build_tool_calls(data, tool_calls, seed)))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdraft.bench.workloads",
                                description="Write the edits and repeated-work bench workloads (Spec-Bench schema "
                                            "plus 'prediction') from GSM8K train and Self-Instruct.")
    p.add_argument("--out", required=True, metavar="DIR", help="writes DIR/edits.jsonl and DIR/repeated.jsonl")
    p.add_argument("--edits", type=int, default=60, metavar="N", help="edit rows (default: 60; 0 skips the file)")
    p.add_argument("--repeated", type=int, default=60, metavar="N",
                   help="repeated-work rows (default: 60; 0 skips the file)")
    p.add_argument("--long-mix", type=int, default=24, metavar="N",
                   help="rows of the long-prompt mix, long_mix.jsonl, for bench-serve (default: 24; 0 skips it)")
    p.add_argument("--multi-turn", type=int, default=8, metavar="N",
                   help="conversations after one shared system prompt, multi_turn.jsonl, for bench-serve "
                        "--multi-turn (default: 8; 0 skips it)")
    p.add_argument("--tool-calls", type=int, default=0, metavar="N",
                   help="requests answered by a tool call, tool_calls.jsonl, for bench-serve (serve with "
                        "--chat-template hermes on a model whose template has no tools; default: 0, none)")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="the shared data folder, holding gsm8k/ and self_instruct/ (default: ../shared/data)")
    p.add_argument("--seed", type=int, default=0, help="default: 0")
    args = p.parse_args(argv)
    if min(args.edits, args.repeated, args.long_mix, args.multi_turn, args.tool_calls) < 0:
        p.error("--edits, --repeated, --long-mix, --multi-turn and --tool-calls must be >= 0")
    try:
        paths = write_workloads(Path(args.out), args.data, args.edits, args.repeated, args.seed, args.long_mix,
                                args.multi_turn, args.tool_calls)
    except (FileNotFoundError, ValueError) as exc:
        print(f"specdraft: error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"wrote {path} ({sum(1 for _ in path.open())} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
