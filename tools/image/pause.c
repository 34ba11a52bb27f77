/* The pod sandbox's pause process for the real-node test tier (registry.k8s.io/pause cannot be
 * pulled here): holds the pod's namespaces, reaps orphans, exits on SIGINT/SIGTERM. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }

int main(void) {
  struct sigaction term = {.sa_handler = stop}, chld = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  sigaction(SIGINT, &term, 0);
  sigaction(SIGTERM, &term, 0);
  sigaction(SIGCHLD, &chld, 0);
  for (;;) pause();
}
