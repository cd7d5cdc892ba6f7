"""`python -m bench.code_lines [DIR ...]`: code lines per directory (default app/ and app/serving/):
lines that are not blank, not only a comment and not part of a docstring (issue 28's measure)."""
import ast
import io
import sys
import tokenize
from pathlib import Path


def code_lines(path: Path) -> int:
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                              tokenize.DEDENT, tokenize.ENDMARKER):
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - docstrings)


def main(dirs: list[str]) -> None:
    for folder in dirs or ["app", "app/serving"]:
        files = sorted(Path(folder).rglob("*.py"))
        print(f"{folder}: {sum(code_lines(f) for f in files)} code lines in {len(files)} modules")


if __name__ == "__main__":
    main(sys.argv[1:])
