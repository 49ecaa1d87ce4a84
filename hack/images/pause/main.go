// Command pause is the pod sandbox ("pause") image's only program: the
// container runtime starts it first in every pod to hold the pod's
// namespaces, and it does nothing but wait until it is told to stop
// (SIGTERM or SIGINT), then exits 0. Zombie reaping is left out: no pod here
// shares its process namespace.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	// As PID 1 of a PID namespace, a process receives only the signals it
	// handles, so it must ask for these explicitly.
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
}
