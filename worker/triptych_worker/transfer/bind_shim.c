/*
 * LD_PRELOAD shim: confine wildcard listeners to one address.
 *
 * Mooncake's transfer engine binds its P2P handshake and TCP data listeners on INADDR_ANY and on
 * a dual-stack in6addr_any socket whatever address it is given, and no setting of it narrows them.
 * Preloaded into a worker (triptych_worker.transfer.listeners re-executes the worker with it), this
 * bind() rewrites exactly those binds to the worker's --disagg-p2p-hostname:
 *
 *   TRIPTYCH_BIND_ADDRESS  an IPv4 or IPv6 literal: where wildcard binds go instead
 *   TRIPTYCH_BIND_PORTS    MIN-MAX (inclusive): only wildcard binds to a port in this range are
 *                          rewritten (Mooncake's MC_MIN_RPC_PORT..MC_MAX_RPC_PORT), so other
 *                          listeners of the process (torch.distributed's store, ...) keep theirs
 *
 * For an IPv4 address an in6addr_any bind becomes the IPv4-mapped ::ffff:A.B.C.D (a dual-stack
 * socket then accepts IPv4 connections to that address only); for an IPv6 address an INADDR_ANY
 * bind fails with EADDRNOTAVAIL (an IPv4 socket cannot take an IPv6 address, and leaving it would
 * listen everywhere). Every other bind (a specific address, a port outside the range, another
 * family) is passed through unchanged. Without TRIPTYCH_BIND_ADDRESS it changes nothing.
 * Both variables are read once, when the library is loaded.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#ifndef TRIPTYCH_BIND_SHIM_ID
#define TRIPTYCH_BIND_SHIM_ID "triptych-bind-shim"
#endif
/* scripts/build-bind-shim.sh finds the hash of the source it was built from here. */
__attribute__((used)) static const char shim_id[] = TRIPTYCH_BIND_SHIM_ID;

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static bind_fn real_bind;
static int target_family; /* 0: not configured */
static struct in_addr target4;
static struct in6_addr target6;
static unsigned min_port = 1, max_port = 65535;

__attribute__((constructor)) static void load_settings(void) {
    real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *address = getenv("TRIPTYCH_BIND_ADDRESS");
    const char *ports = getenv("TRIPTYCH_BIND_PORTS");
    if (address == NULL || *address == '\0') return;
    if (inet_pton(AF_INET, address, &target4) == 1) {
        target_family = AF_INET;
    } else if (inet_pton(AF_INET6, address, &target6) == 1) {
        target_family = AF_INET6;
    } else {
        fprintf(stderr, "triptych bind shim: TRIPTYCH_BIND_ADDRESS %s is not an IP address; binds left alone\n",
                address);
        return;
    }
    if (ports != NULL && *ports != '\0') {
        unsigned low, high;
        if (sscanf(ports, "%u-%u", &low, &high) != 2 || low > high || high > 65535) {
            fprintf(stderr, "triptych bind shim: TRIPTYCH_BIND_PORTS %s is not MIN-MAX; binds left alone\n", ports);
            target_family = 0;
            return;
        }
        min_port = low;
        max_port = high;
    }
}

static int in_range(in_port_t port) {
    unsigned p = ntohs(port);
    return p >= min_port && p <= max_port;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    if (real_bind == NULL) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (target_family == 0 || addr == NULL) return real_bind(fd, addr, len);

    if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in sin;
        memcpy(&sin, addr, sizeof sin);
        if (sin.sin_addr.s_addr != htonl(INADDR_ANY) || !in_range(sin.sin_port)) return real_bind(fd, addr, len);
        if (target_family != AF_INET) {
            errno = EADDRNOTAVAIL;
            return -1;
        }
        sin.sin_addr = target4;
        return real_bind(fd, (const struct sockaddr *)&sin, sizeof sin);
    }

    if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 sin6;
        memcpy(&sin6, addr, sizeof sin6);
        if (!IN6_IS_ADDR_UNSPECIFIED(&sin6.sin6_addr) || !in_range(sin6.sin6_port)) return real_bind(fd, addr, len);
        if (target_family == AF_INET6) {
            sin6.sin6_addr = target6;
        } else {
            memset(&sin6.sin6_addr, 0, sizeof sin6.sin6_addr);
            sin6.sin6_addr.s6_addr[10] = 0xff;
            sin6.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&sin6.sin6_addr.s6_addr[12], &target4, sizeof target4);
        }
        return real_bind(fd, (const struct sockaddr *)&sin6, sizeof sin6);
    }

    return real_bind(fd, addr, len);
}
