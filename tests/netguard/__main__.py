"""``python -m netguard <command ...>`` (from tests/): run a command under strace, print every connect or sendto
that left loopback, exit 1 if one did (else the command's own exit code)."""

import subprocess
import sys
import tempfile
from pathlib import Path

from netguard import outside, traced

with tempfile.NamedTemporaryFile("r", suffix=".strace") as log:
    code = subprocess.run(traced(sys.argv[1:], log.name)).returncode
    lines = outside(Path(log.name).read_text())
print("\n".join(lines) or "every connect/sendto stayed on loopback")
sys.exit(1 if lines else code)
