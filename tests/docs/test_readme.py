"""The README stays true: its Python example runs, and its two commands are the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_python_example_runs(capsys) -> None:
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    assert "spec P('tp', None)" in capsys.readouterr().out


def test_two_commands_open_the_readme() -> None:
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).splitlines()
    assert block[0].startswith("pip install torch==2.13.0 -e . && python -m funcshard train")
    assert block[1].startswith('pip install torch==2.13.0 -e ".[test]" && python -m pytest')
    assert "grep -m1 -E '^pip install .*python -m pytest' README.md" in (ROOT / ".ci" / "run").read_text()
