#!/usr/bin/env python3
"""Server CPU seconds of the PostgreSQL whose postmaster pid is argv[1]: the postmaster's
utime+stime+cutime+cstime plus utime+stime of its live children (bench/src/procfs.rs).
As a module: server_cpu(pid) and, per backend type, breakdown(pid)."""
import os, sys

TCK = os.sysconf('SC_CLK_TCK')

def _fields(pid):
    with open(f'/proc/{pid}/stat') as f:
        s = f.read()
    return s[s.rindex(')') + 2:].split()

def server_cpu(pm):
    ticks = 0
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            f = _fields(name)
        except OSError:
            continue
        if int(name) == pm:
            ticks += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
        elif int(f[1]) == pm:
            ticks += int(f[11]) + int(f[12])
    return ticks / TCK

def children(pm):
    """{pid: (cmdline, cpu seconds)} of the live children."""
    out = {}
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            f = _fields(name)
            if int(f[1]) != pm:
                continue
            with open(f'/proc/{name}/cmdline', 'rb') as c:
                cmd = c.read().replace(b'\0', b' ').decode(errors='replace').strip()
        except OSError:
            continue
        out[int(name)] = (cmd, (int(f[11]) + int(f[12])) / TCK)
    return out

if __name__ == '__main__':
    print(f'{server_cpu(int(sys.argv[1])):.2f}')
