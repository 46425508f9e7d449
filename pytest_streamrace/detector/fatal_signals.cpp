// A native stack for a process that dies of a fatal signal under the detector.
//
// faulthandler (pytest's, and every rank's: launcher/forkserver.py) prints the Python stacks of a crash, which says
// nothing where the crashing thread runs no Python (a library's worker: NCCL's, CUDA's, a C++ pool) or is deep in
// native code. This handler goes in front of whatever handles the signal already: it writes the crashing thread's
// native frames (library and symbol or offset, from the dynamic symbol tables) to stderr, headed by a line the
// launcher's rank report looks for, then hands the signal back to the handler it displaced (faulthandler's dump, then
// the default action). Joined into the capture's module (capture.load), so it is on wherever the capture is.
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstring>

namespace fatal_signals {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
struct sigaction displaced[NSIG];
int out_fd = 2;
bool installed = false;

void put(const char* text) { (void)!write(out_fd, text, strlen(text)); }

void put_number(long value) {  // async-signal-safe: no stdio
  char digits[24];
  int i = sizeof(digits) - 1;
  digits[i] = '\0';
  unsigned long u = value < 0 ? -static_cast<unsigned long>(value) : value;
  do {
    digits[--i] = static_cast<char>('0' + u % 10);
    u /= 10;
  } while (u != 0 && i > 1);
  if (value < 0) digits[--i] = '-';
  put(digits + i);
}

const char* name_of(int signo) {  // strsignal may take the locale's lock: not in a signal handler
  switch (signo) {
    case SIGSEGV: return "Segmentation fault";
    case SIGBUS: return "Bus error";
    case SIGFPE: return "Floating point exception";
    case SIGILL: return "Illegal instruction";
    case SIGABRT: return "Aborted";
    default: return "?";
  }
}

void on_signal(int signo, siginfo_t*, void*) {
  static volatile sig_atomic_t entered = 0;
  if (!entered) {  // a second fault while writing: straight on to the displaced handler
    entered = 1;
    char name[32] = "?";
    pthread_getname_np(pthread_self(), name, sizeof(name));
    put("streamrace: native stack of the thread that got signal ");
    put_number(signo);
    put(" (");
    put(name_of(signo));
    put("), thread id ");
    put_number(static_cast<long>(syscall(SYS_gettid)));
    put(" \"");
    put(name);
    put("\", innermost first:\n");
    void* frames[64];
    int depth = backtrace(frames, 64);
    backtrace_symbols_fd(frames, depth, out_fd);
  }
  sigaction(signo, &displaced[signo], nullptr);
  raise(signo);  // pending until this returns, then the displaced handler (faulthandler's dump) or the default
}

// `fd` is where the stack goes; installed once a process (a forked one keeps its parent's handler), then only
// `fd` changes.
void install(int fd) {
  out_fd = fd;
  if (installed) return;
  installed = true;
  void* warm[2];
  backtrace(warm, 2);  // loads the unwinder now: its first call allocates, which a signal handler must not
  for (int signo : kSignals) {
    struct sigaction act;
    memset(&act, 0, sizeof(act));
    act.sa_sigaction = on_signal;
    act.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&act.sa_mask);
    sigaction(signo, &act, &displaced[signo]);
  }
}

// For the tests: a fault on a new native thread, as a library's worker would have one.
void crash_on_a_native_thread() {
  pthread_t thread;
  pthread_create(&thread, nullptr, [](void*) -> void* {
    pthread_setname_np(pthread_self(), "sr-native-test");
    raise(SIGSEGV);
    return nullptr;
  }, nullptr);
  pthread_join(thread, nullptr);
}

}  // namespace fatal_signals
