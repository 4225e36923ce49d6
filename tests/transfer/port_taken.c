/*
 * Fault injection for tests/transfer/test_engine_start.py (LD_PRELOAD): the race Mooncake's TCP
 * transport loses when another process takes the port it chose.
 *
 * Mooncake picks its data port by binding a test socket there, closes it, then binds its listener
 * to the same port. Here, for the first PORT_TAKEN_TIMES ports bound that way, every bind after the
 * test bind fails with EADDRINUSE, as if another process had taken the port in between. Other binds
 * pass through.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int times_left = -1;
static unsigned last_bound, taken;

static unsigned port_of(const struct sockaddr *address) {
    if (address == NULL) return 0;
    if (address->sa_family == AF_INET) return ntohs(((const struct sockaddr_in *)address)->sin_port);
    if (address->sa_family == AF_INET6) return ntohs(((const struct sockaddr_in6 *)address)->sin6_port);
    return 0;
}

int bind(int fd, const struct sockaddr *address, socklen_t length) {
    static bind_fn real_bind;
    if (real_bind == NULL) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (times_left < 0) {
        const char *times = getenv("PORT_TAKEN_TIMES");
        times_left = times ? atoi(times) : 0;
    }
    unsigned port = port_of(address);
    if (port != 0 && port == taken) {
        errno = EADDRINUSE;
        return -1;
    }
    if (port != 0 && port == last_bound && times_left > 0) {
        times_left--;
        taken = port;
        errno = EADDRINUSE;
        return -1;
    }
    int rc = real_bind(fd, address, length);
    if (rc == 0 && port != 0) last_bound = port;
    return rc;
}
