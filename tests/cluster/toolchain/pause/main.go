// The pod sandbox's pause process: sleeps until SIGTERM or SIGINT, and reaps orphaned children
// when it runs as PID 1 of a pod sharing its PID namespace.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	chld := make(chan os.Signal, 16)
	signal.Notify(chld, syscall.SIGCHLD)
	for {
		select {
		case <-sig:
			os.Exit(0)
		case <-chld:
			for {
				pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
		}
	}
}
