"""Prerequisites checked before anything starts, each failing in one line that says what to install."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from millpond.errors import PrerequisiteMissing


def require_java(min_major: int = 17) -> str:
    """Spark needs Java 17+: say so in one line rather than let py4j fail obscurely."""
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise PrerequisiteMissing(
            "Java not found: install a JDK 17+ (e.g. `apt-get install openjdk-17-jre-headless`) or set JAVA_HOME"
        )
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    major = int(match.group(1)) if match else 0
    if major == 1 and match and match.group(2):
        major = int(match.group(2))
    if major < min_major:
        raise PrerequisiteMissing(
            f"Java {major} found at {java}: Spark needs Java {min_major}+; install it or set JAVA_HOME"
        )
    return java
