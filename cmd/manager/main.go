// Command manager will run the OutboxRelay controller.
package main

func main() {}
