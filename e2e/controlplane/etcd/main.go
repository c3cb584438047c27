// Command etcd runs one etcd member for the test control plane: go.etcd.io's
// embedded server on loopback, data in --data-dir, stopped by SIGTERM/SIGINT.
package main

import (
	"flag"
	"log"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

func mustURL(s string) url.URL {
	u, err := url.Parse(s)
	if err != nil {
		log.Fatalf("etcd: bad url %q: %v", s, err)
	}
	return *u
}

func main() {
	dataDir := flag.String("data-dir", "", "data directory (required)")
	client := flag.String("listen-client-url", "http://127.0.0.1:2379", "client URL (loopback)")
	peer := flag.String("listen-peer-url", "http://127.0.0.1:2380", "peer URL (loopback)")
	flag.Parse()
	if *dataDir == "" {
		log.Fatal("etcd: --data-dir is required")
	}

	cfg := embed.NewConfig()
	cfg.Name = "kvfleet-test"
	cfg.Dir = *dataDir
	cfg.LogLevel = "warn"
	c, p := mustURL(*client), mustURL(*peer)
	cfg.ListenClientUrls = []url.URL{c}
	cfg.AdvertiseClientUrls = []url.URL{c}
	cfg.ListenPeerUrls = []url.URL{p}
	cfg.AdvertisePeerUrls = []url.URL{p}
	cfg.InitialCluster = cfg.Name + "=" + p.String()
	// A throwaway test store: no fsync per write, small backend, no snapshots to speak of.
	cfg.UnsafeNoFsync = true
	cfg.QuotaBackendBytes = 2 << 30
	cfg.AutoCompactionMode = "periodic"
	cfg.AutoCompactionRetention = "5m"

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("etcd: start: %v", err)
	}
	select {
	case <-e.Server.ReadyNotify():
		log.Printf("etcd: ready on %s", c.String())
	case <-time.After(60 * time.Second):
		e.Server.Stop()
		log.Fatal("etcd: not ready after 60s")
	}

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	select {
	case s := <-sig:
		log.Printf("etcd: %s, stopping", s)
		e.Close()
	case err := <-e.Err():
		log.Fatalf("etcd: %v", err)
	}
}
