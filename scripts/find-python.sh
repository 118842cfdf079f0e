#!/usr/bin/env sh
# Print the path of a Python 3.12 interpreter, or fail. Tries, in order: $PYTHON,
# python3.12 on PATH, pyenv's 3.12.x (pyenv shims answer only with PYENV_VERSION set),
# python3 if it is 3.12, and uv's managed interpreters.
check() { "$@" -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)' 2>/dev/null; }
for c in "${PYTHON:-}" python3.12; do
  [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && check "$c" && exit 0
done
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  for v in $(ls -1 "$root/versions" 2>/dev/null | grep '^3\.12' | sort -r); do
    check "$root/versions/$v/bin/python3" && exit 0
  done
fi
for c in python3 /usr/bin/python3.12 /usr/local/bin/python3.12; do
  command -v "$c" >/dev/null 2>&1 && check "$c" && exit 0
done
if command -v uv >/dev/null 2>&1; then p=$(uv python find 3.12 2>/dev/null) && check "$p" && exit 0; fi
echo "no Python 3.12 interpreter found: install python3.12 or set PYTHON=/path/to/python3.12" >&2
exit 1
