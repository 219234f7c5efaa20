#!/usr/bin/env python3
"""A stage's technique steps: the stage's files rebuilt from the files it starts from, one
technique at a time, each step a patch a reader can open on its own.

A stage with steps has a folder STAGE/steps/ holding
  BASE          which file of an earlier stage each of the stage's files starts from;
  NN-name.patch the steps, in order: a few lines saying what the technique is and why, then a
                unified diff (paths STAGE/file, as `diff -u` or `git diff` writes them) that
                applies to the files as the steps before it left them.
The last step leaves exactly the stage's files; the A/B table of the stage's README times
each step (scripts/variants.sh, a variant `LABEL=step:NN`).

  scripts/steps.py check STAGE...        the patches apply, in order, and end at the stage's files
  scripts/steps.py lines STAGE           changed lines of each step, file by file
  scripts/steps.py tree STAGE NN DIR     DIR becomes a copy of the repository's layout in which
                                         STAGE holds step NN's files (0: BASE's), the other
                                         folders linked, so that it builds as the stage does
  scripts/steps.py build STAGE NN OUT -- COMPILER FLAG...
                                         compiles step NN's program into OUT: COMPILER
                                         STAGE/attention.cu FLAG... -o OUT, in such a tree
  scripts/steps.py write STAGE DIR...    (contributors) rewrites the patches from snapshots:
                                         DIR1 holds the stage's files after step 1, and so on
                                         (a folder `tree` made will do: its links to the
                                         stage's other files are not step files and are
                                         skipped); each patch keeps its name and description

Standard library only; exit status 0, 1 when a check fails, 2 on bad arguments.
"""
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def fail(message, status=1):
    print(f"steps.py: {message}", file=sys.stderr)
    sys.exit(status)


def steps_dir(stage):
    path = os.path.join(ROOT, stage, "steps")
    if not os.path.isfile(os.path.join(path, "BASE")):
        fail(f"{stage} has no steps ({stage}/steps/BASE is missing)", 2)
    return path


def patches(stage):
    folder = steps_dir(stage)
    names = sorted(n for n in os.listdir(folder) if re.match(r"^\d\d-[\w-]+\.patch$", n))
    if [int(n[:2]) for n in names] != list(range(1, len(names) + 1)):
        fail(f"{stage}/steps: the patches must be numbered 01, 02, ... without gaps", 2)
    return [os.path.join(folder, n) for n in names]


def base_files(stage):
    """{file name in the stage: its lines}, from BASE."""
    files = {}
    with open(os.path.join(steps_dir(stage), "BASE")) as f:
        for line in f:
            line = line.split("#", 1)[0].split()
            if not line:
                continue
            if len(line) != 2:
                fail(f"{stage}/steps/BASE: '{' '.join(line)}' is not 'FILE EARLIER_STAGE/FILE'", 2)
            with open(os.path.join(ROOT, line[1])) as src:
                files[line[0]] = src.read().splitlines(keepends=True)
    return files


def split_patch(path):
    """The description (the lines before the first '--- ') and [(old, new, hunks)]."""
    with open(path) as f:
        lines = f.read().splitlines(keepends=True)
    start = next((i for i, l in enumerate(lines) if l.startswith("--- ")), len(lines))
    description, body, files = lines[:start], lines[start:], []
    i = 0
    while i < len(body):
        if not body[i].startswith("--- ") or i + 1 >= len(body) or not body[i + 1].startswith("+++ "):
            fail(f"{os.path.basename(path)}: line {start + i + 1} is not a file header", 1)
        old, new = (body[i][4:].split("\t")[0].strip(), body[i + 1][4:].split("\t")[0].strip())
        i += 2
        hunks = []
        while i < len(body) and body[i].startswith("@@"):
            m = HUNK.match(body[i])
            if not m:
                fail(f"{os.path.basename(path)}: bad hunk header at line {start + i + 1}", 1)
            old_start, old_count = int(m[1]), int(m[2] if m[2] is not None else 1)
            new_count = int(m[4] if m[4] is not None else 1)
            i += 1
            old_lines, new_lines = [], []
            while i < len(body) and (len(old_lines) < old_count or len(new_lines) < new_count):
                line = body[i]
                tag, text = line[:1], line[1:]
                if tag == "\\":  # "\ No newline at end of file"
                    i += 1
                    continue
                if tag in (" ", ""):
                    old_lines.append(text or "\n"), new_lines.append(text or "\n")
                elif tag == "-":
                    old_lines.append(text)
                elif tag == "+":
                    new_lines.append(text)
                else:
                    fail(f"{os.path.basename(path)}: bad line {start + i + 1} in a hunk", 1)
                i += 1
            hunks.append((old_start, old_lines, new_lines))
        while i < len(body) and body[i].startswith("\\"):
            i += 1
        files.append((old, new, hunks))
    return description, files


def stage_name(path, stage):
    """'a/STAGE/forward.cuh' -> 'forward.cuh'; /dev/null -> None."""
    if path == "/dev/null":
        return None
    parts = path.split("/")
    if parts[0] in ("a", "b"):
        parts = parts[1:]
    if len(parts) != 2 or parts[0] != stage:
        fail(f"{stage}: a step patches {path}, which is not a file of {stage}", 1)
    return parts[1]


def apply(stage, files, path):
    """Applies one patch to files ({name: lines}) in place; every hunk must match exactly where
    it says."""
    _, changes = split_patch(path)
    for old, new, hunks in changes:
        old_name, new_name = stage_name(old, stage), stage_name(new, stage)
        if old_name is None:
            if new_name in files:
                fail(f"{os.path.basename(path)} creates {new_name}, which exists already", 1)
            text = []
        else:
            if old_name not in files:
                fail(f"{os.path.basename(path)} patches {old_name}, which does not exist yet", 1)
            text = files.pop(old_name)
        shift = 0
        for old_start, old_lines, new_lines in hunks:
            at = old_start - 1 + shift if old_lines else old_start + shift
            if text[at:at + len(old_lines)] != old_lines:
                fail(f"{os.path.basename(path)}: a hunk at line {old_start} of {old_name} does "
                     "not match the file the steps before it leave", 1)
            text[at:at + len(old_lines)] = new_lines
            shift += len(new_lines) - len(old_lines)
        if new_name is not None:
            files[new_name] = text


def step_files(stage, upto):
    files = base_files(stage)
    for path in patches(stage)[:upto]:
        apply(stage, files, path)
    return files


def check(stages):
    bad = 0
    for stage in stages:
        steps = patches(stage)
        files = step_files(stage, len(steps))
        differ = False
        for name, lines in sorted(files.items()):
            with open(os.path.join(ROOT, stage, name)) as f:
                if f.read().splitlines(keepends=True) != lines:
                    print(f"{stage}: after the last step {name} differs from {stage}/{name}"
                          " (scripts/steps.py write regenerates the patches)")
                    differ = True
        bad = bad or differ
        if not differ:
            print(f"{stage}: {len(steps)} steps apply in order and end at "
                  f"{', '.join(sorted(files))}")
    return bad


def changed(a, b):
    return sum(1 for l in difflib.unified_diff(a, b, n=0)
               if l[:1] in "+-" and not l.startswith(("+++", "---")))


def step_lines(stage):
    """[(patch path, {file: changed lines})] for each step, the files it changes only."""
    result, before = [], base_files(stage)
    for path in patches(stage):
        after = {name: list(text) for name, text in before.items()}
        apply(stage, after, path)
        result.append((path, {n: changed(before.get(n, []), after.get(n, []))
                              for n in sorted(set(before) | set(after))
                              if before.get(n) != after.get(n)}))
        before = after
    return result


def lines(stage):
    for path, counts in step_lines(stage):
        text = ", ".join(f"{n} {c}" for n, c in counts.items())
        print(f"{os.path.basename(path)}\t{sum(counts.values())}\t{text}")


def tree(stage, step, out):
    files = step_files(stage, step)
    os.makedirs(os.path.join(out, stage), exist_ok=True)
    for entry in os.listdir(ROOT):
        link = os.path.join(out, entry)
        if entry != stage and not entry.startswith(".") and not os.path.lexists(link):
            os.symlink(os.path.join(ROOT, entry), link)
    for entry in os.listdir(os.path.join(ROOT, stage)):  # CMakeLists.txt, tests, ...
        if entry not in files and entry != "steps" and not os.path.lexists(
                os.path.join(out, stage, entry)):
            os.symlink(os.path.join(ROOT, stage, entry), os.path.join(out, stage, entry))
    for name, text in files.items():
        with open(os.path.join(out, stage, name), "w") as f:
            f.writelines(text)
    return os.path.join(out, stage)


def build(stage, step, out, command):
    out = os.path.abspath(out)  # the compiler runs in the tree
    folder = tempfile.mkdtemp(prefix=f"{stage}-step{step:02d}-")
    try:
        tree(stage, step, folder)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        source = os.path.join(folder, stage, "attention.cu")
        compile_command = [command[0], source] + command[1:] + ["-o", out]
        print(" ".join(compile_command), flush=True)
        status = subprocess.call(compile_command, cwd=folder)
        if status:
            fail(f"{stage} step {step:02d} did not build (exit {status})")
        print(f"{stage} step {step:02d}: {out}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def write(stage, snapshots):
    steps = patches(stage)
    if len(snapshots) != len(steps):
        fail(f"{stage} has {len(steps)} steps; give as many snapshot folders", 2)
    before = base_files(stage)
    for path, folder in zip(steps, snapshots):
        after = {}
        for name in sorted(set(before) | set(os.listdir(folder))):
            file = os.path.join(folder, name)
            if os.path.isfile(file) and not os.path.islink(file):
                with open(file) as f:
                    after[name] = f.read().splitlines(keepends=True)
        description, _ = split_patch(path)
        body = []
        for name in sorted(set(before) | set(after)):
            old, new = before.get(name), after.get(name)
            if old == new:
                continue
            body += difflib.unified_diff(old or [], new or [],
                                         f"a/{stage}/{name}" if old is not None else "/dev/null",
                                         f"b/{stage}/{name}" if new is not None else "/dev/null")
        with open(path, "w") as f:
            f.writelines(description + body)
        before = after
    print(f"{stage}: {len(steps)} patches written")


def main(argv):
    if len(argv) < 2 or argv[0] not in ("check", "lines", "tree", "build", "write"):
        fail("usage: steps.py check STAGE... | lines STAGE | tree STAGE NN DIR | "
             "build STAGE NN OUT -- COMPILER FLAG... | write STAGE DIR...", 2)
    command, stage = argv[0], argv[1].rstrip("/")
    if command == "check":
        return check([s.rstrip("/") for s in argv[1:]])
    if command == "lines":
        return lines(stage)
    if command == "tree":
        if len(argv) != 4 or not argv[2].isdigit() or int(argv[2]) > len(patches(stage)):
            fail(f"usage: steps.py tree STAGE NN DIR, NN from 0 to {len(patches(stage))}", 2)
        return print(tree(stage, int(argv[2]), argv[3]))
    if command == "build":
        if (len(argv) < 6 or argv[4] != "--" or not argv[2].isdigit()
                or not 1 <= int(argv[2]) <= len(patches(stage))):
            fail(f"usage: steps.py build STAGE NN OUT -- COMPILER FLAG..., NN from 1 to "
                 f"{len(patches(stage))}", 2)
        return build(stage, int(argv[2]), argv[3], argv[5:])
    return write(stage, argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]) or 0)
