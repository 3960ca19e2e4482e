"""Parse Burn 0.21.0's backend ops traits: every method's name, generics, arguments and return type."""
import glob, os, re

TRAITS = [
    ("FloatTensorOps", "ops/tensor.rs"),
    ("IntTensorOps", "ops/int_tensor.rs"),
    ("BoolTensorOps", "ops/bool_tensor.rs"),
    ("ModuleOps", "ops/modules/base.rs"),
    ("ActivationOps", "ops/activation.rs"),
    ("QTensorOps", "ops/qtensor.rs"),
    ("TransactionOps", "ops/transaction.rs"),
]


def backend_src():
    home = os.environ.get("CARGO_HOME", os.path.expanduser("~/.cargo"))
    hits = glob.glob(os.path.join(home, "registry/src/*/burn-backend-0.21.0/src/backend"))
    if not hits:
        raise SystemExit("burn-backend-0.21.0 sources not found: run `cargo fetch` first")
    return hits[0]


def split_top(s, sep=","):
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "<([{":
            depth += 1
        elif ch in ">)]}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return [x.strip() for x in out if x.strip()]


def trait_body(src, trait):
    m = re.search(r"pub trait " + trait + r"\b[^{]*\{", src)
    i = m.end()
    depth = 1
    j = i
    while depth:
        if src[j] == "{":
            depth += 1
        elif src[j] == "}":
            depth -= 1
        j += 1
    return src[i : j - 1]


def methods(trait, path):
    src = open(os.path.join(backend_src(), path)).read()
    src = re.sub(r"//[^\n]*", "", src)
    body = trait_body(src, trait)
    out = []
    i = 0
    while True:
        m = re.search(r"\b(async\s+)?fn\s+(\w+)", body[i:])
        if not m:
            break
        start = i + m.start()
        # find end of signature: ';' or '{' at depth 0 (angle brackets and parens)
        j = i + m.end()
        depth = 0
        while True:
            ch = body[j]
            if ch in "(<[":
                depth += 1
            elif ch in ")>]":
                # '->' is not a closing bracket
                if not (ch == ">" and body[j - 1] == "-"):
                    depth -= 1
            elif ch in ";{" and depth == 0:
                break
            j += 1
        sig = body[start:j]
        defaulted = body[j] == "{"
        if defaulted:
            depth = 1
            k = j + 1
            while depth:
                if body[k] == "{":
                    depth += 1
                elif body[k] == "}":
                    depth -= 1
                k += 1
            i = k
        else:
            i = j + 1
        out.append(parse_sig(sig, defaulted))
    return out


def parse_sig(sig, defaulted):
    sig = " ".join(sig.split())
    is_async = sig.startswith("async ")
    m = re.match(r"(?:async\s+)?fn\s+(\w+)\s*", sig)
    name = m.group(1)
    rest = sig[m.end():]
    generics = ""
    if rest.startswith("<"):
        depth = 0
        for idx, ch in enumerate(rest):
            if ch == "<":
                depth += 1
            elif ch == ">":
                depth -= 1
                if depth == 0:
                    generics = rest[: idx + 1]
                    rest = rest[idx + 1 :].strip()
                    break
    # arguments
    assert rest.startswith("("), sig
    depth = 0
    for idx, ch in enumerate(rest):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                args_s = rest[1:idx]
                rest = rest[idx + 1 :].strip()
                break
    args = []
    for a in split_top(args_s):
        n, t = a.split(":", 1)
        n = n.strip().lstrip("_") if n.strip() != "_" else "_"
        args.append((n.replace("mut ", "").strip(), t.strip(), "mut " in a.split(":")[0]))
    ret, where = "", ""
    if rest.startswith("->"):
        rest = rest[2:].strip()
        wi = rest.find(" where ")
        if wi >= 0:
            ret, where = rest[:wi].strip(), rest[wi:].strip()
        else:
            ret = rest.strip()
    elif rest.startswith("where"):
        where = rest
    return dict(name=name, generics=generics, args=args, ret=ret, where=where,
                is_async=is_async, defaulted=defaulted, sig=sig)


if __name__ == "__main__":
    total = 0
    for trait, path in TRAITS:
        ms = methods(trait, path)
        total += len(ms)
        print(trait, len(ms), sum(m["defaulted"] for m in ms))
    print("total", total)
