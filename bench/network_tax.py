"""TCP traffic between two emulated hosts, both directions at once over one connection, for a
fixed time (or until SIGTERM): what an all-reduce between the hosts puts on the link, without
any MPI library.

    network_tax.py serve PORT SECONDS           (on one host)
    network_tax.py send ADDRESS PORT SECONDS    (on the other)

Each side sends 1 MiB writes from one thread and reads into a reused buffer on another, so the
process's own user time stays near zero and what it costs the machine is the kernel's network
work. Each side prints the megabytes per second it received.
"""

import signal
import socket
import sys
import threading
import time

CHUNK = 1 << 20


def exchange(sock, seconds):
    payload = bytes(CHUNK)
    end = time.monotonic() + seconds

    def sender():
        while time.monotonic() < end:
            sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=sender, daemon=True)
    start = time.monotonic()
    thread.start()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    received = 0
    try:
        while True:
            n = sock.recv_into(view)
            if n == 0:
                break
            received += n
        thread.join()
    except SystemExit:  # SIGTERM: the caller's work is done before the time is up
        pass
    elapsed = time.monotonic() - start
    print("received %.1f MB/s over %.1f s" % (received / elapsed / 1e6, elapsed), flush=True)


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    mode = sys.argv[1]
    if mode == "serve":
        port, seconds = int(sys.argv[2]), float(sys.argv[3])
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", port))
        listener.listen(1)
        sock, _ = listener.accept()
        exchange(sock, seconds)
    elif mode == "send":
        address, port, seconds = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
        deadline = time.monotonic() + 10
        while True:
            try:
                sock = socket.create_connection((address, port))
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        exchange(sock, seconds)
    else:
        sys.exit("usage: network_tax.py serve PORT SECONDS | send ADDRESS PORT SECONDS")


if __name__ == "__main__":
    main()
