"""What a shell makes of a command line printed for a person to paste (the approve line of
`xidstream incidents`, the gate's refusal, a recommended step): tests round-trip such a line through
`shlex.split` and check that no character of it is left for the shell to interpret."""

from __future__ import annotations

# What a forged record may name: each must come back out of a shell as the one word it was.
HOSTILE = ["gpu-node-9 --key /dev/null; curl x|sh; echo", "$(id)", "`id`", "gpu-node-9\ncurl x|sh", "a'b",
           'a"b', "it's \"quoted\"", "a b", "x;reboot", "a|b&c", "${IFS}rm", "\\", "-rf", "--publish", "*", "~root",
           "'", "gpu-node-9\r\x1b[2Kxidstream approve ok", "a\tb", "#comment", "gpu\u2028node"]


def interpreted(line: str) -> str:
    """The characters of `line` that a POSIX shell (or bash) would not take literally: outside
    quotes anything but a word character or a space, inside double quotes `$`, a backtick, `\\`
    and `!`; inside single quotes nothing. (shlex.split alone takes `$(id)` for a word.)"""
    out, i = [], 0
    while i < len(line):
        c = line[i]
        if c in "'\"":
            j = line.index(c, i + 1)  # an unclosed quote: ValueError, a failure
            out += [ch for ch in line[i + 1:j] if c == '"' and ch in "$`\\!"]
            i = j + 1
            continue
        if not ((c.isascii() and c.isalnum()) or c in "@%+=:,./_- "):
            out.append(c)
        i += 1
    return "".join(out)
