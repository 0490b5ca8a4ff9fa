"""README's Python quick start runs as written (with 3 fit steps instead of 1000)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_python_quick_start_runs(tmp_path):
    readme = open(os.path.join(ROOT, "README.md")).read()
    code = re.search(r"## Python quick start\s+```python\n(.*?)```", readme, re.S).group(1)
    assert "PipelineDPTrainer(" in code and "trainer.fit(" in code
    script = tmp_path / "quickstart.py"
    script.write_text(code.replace("steps=1000", "steps=3"))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
