/* Loaded (LD_PRELOAD) into every process the test suite starts, so that naming a loopback peer never asks a DNS
 * server.
 *
 * torch.distributed's TCP store listens on a dual-stack socket and names each peer it accepts with
 * getnameinfo(::ffff:127.0.0.1) for its log. glibc answers a v4-mapped address from /etc/hosts only when the file
 * holds that exact IPv6 entry (few do), and otherwise sends a reverse query (1.0.0.127.in-addr.arpa PTR) to the
 * machine's resolver: an address outside 127.0.0.0/8, which no test may reach. This wrapper asks glibc for the
 * numeric form of loopback addresses (127.0.0.0/8, ::1 and ::ffff:127.0.0.0/104) and passes every other call
 * through unchanged. It changes a log line's text ("127.0.0.1" for "localhost"), nothing else. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*getnameinfo_fn)(const struct sockaddr *, socklen_t, char *, socklen_t, char *, socklen_t, int);

static int is_loopback(const struct sockaddr *sa, socklen_t len) {
    if (sa == NULL) return 0;
    if (sa->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        const unsigned char *a = (const unsigned char *)&((const struct sockaddr_in *)sa)->sin_addr;
        return a[0] == 127;
    }
    if (sa->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        if (IN6_IS_ADDR_LOOPBACK(a)) return 1;
        return IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127;
    }
    return 0;
}

int getnameinfo(const struct sockaddr *sa, socklen_t salen, char *host, socklen_t hostlen, char *serv,
                socklen_t servlen, int flags) {
    static getnameinfo_fn real = NULL;
    if (real == NULL) real = (getnameinfo_fn)dlsym(RTLD_NEXT, "getnameinfo");
    if (is_loopback(sa, salen)) flags |= NI_NUMERICHOST;
    return real(sa, salen, host, hostlen, serv, servlen, flags);
}
