#!/usr/bin/env python3
"""The shape of kiln's code, for the core-in-layers issue's before/after figures:

- lines of Rust per crate (src/ only);
- the longest functions (by lines, from `fn` to its closing brace), top N;
- thread-locals and statics that carry context (`thread_local!` entries and `static` items
  outside tests), per crate.

    python3 scripts/code-shape.py            # from the workspace root
    python3 scripts/code-shape.py --top 10
"""
import os
import re
import sys

TOP = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 5


def crates():
    out = []
    for top in ("crates", "models", "examples"):
        if os.path.isdir(top):
            for c in sorted(os.listdir(top)):
                if os.path.isdir(os.path.join(top, c, "src")):
                    out.append(os.path.join(top, c))
    return out


def files(crate):
    for root, _, names in os.walk(os.path.join(crate, "src")):
        for n in sorted(names):
            if n.endswith(".rs"):
                yield os.path.join(root, n)


def strip_tests(text):
    m = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)
    return text[: m.start()] if m else text


def functions(path):
    lines = strip_tests(open(path, encoding="utf-8").read()).split("\n")
    out = []
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"\s*(pub(\([^)]*\))?\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)", line)
        if m and not line.strip().startswith("//"):
            name = m.group(5)
            depth, start, j, opened = 0, i, i, False
            while j < len(lines):
                code = re.sub(r'"(\\.|[^"\\])*"', '""', lines[j].split("//")[0])
                if ";" in code and not opened and "{" not in code:
                    break  # a declaration without a body
                depth += code.count("{") - code.count("}")
                opened = opened or "{" in code
                if opened and depth <= 0:
                    out.append((j - start + 1, name, path, start + 1))
                    break
                j += 1
            i = j + 1 if opened else i + 1
            continue
        i += 1
    return out


def statics(path):
    text = strip_tests(open(path, encoding="utf-8").read())
    n = 0
    for block in re.finditer(r"thread_local!\s*\{(.*?)\n\}", text, re.S):
        n += len(re.findall(r"\bstatic\s+\w+", block.group(1)))
    text = re.sub(r"thread_local!\s*\{.*?\n\}", "", text, flags=re.S)
    n += len(re.findall(r"^\s*(pub(\([^)]*\))?\s+)?static\s+(mut\s+)?[A-Z_][A-Z0-9_]*\s*:", text, re.M))
    return n


def main():
    allf = []
    print(f"{'crate':<28} {'lines':>7} {'statics+TLS':>12}")
    for c in crates():
        lines = sum(len(open(f, encoding="utf-8").read().split("\n")) for f in files(c))
        st = sum(statics(f) for f in files(c))
        print(f"{c:<28} {lines:>7} {st:>12}")
        for f in files(c):
            allf.extend(functions(f))
    allf.sort(reverse=True)
    print(f"\nlongest functions (top {TOP}):")
    for n, name, path, line in allf[:TOP]:
        print(f"  {n:>4} lines  {name}  {path}:{line}")


main()
