package localcluster

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
)

// The node's pod network: a Linux bridge the stack creates, whose host-side
// address is where pods reach everything on this machine (the API server,
// PostgreSQL, Kafka). The CNI bridge plugin attaches each pod to it.
const (
	// BridgeName is the bridge's interface name.
	BridgeName = "outbox0"
	// HostIP is the bridge's address: this machine, as pods see it.
	HostIP = "10.213.0.1"
	// PodCIDR is the pods' network (host-local IPAM hands out its addresses).
	PodCIDR = "10.213.0.0/16"
	// NodeName is the one node's name.
	NodeName = "outbox-node"
)

// ensureBridge creates the bridge with HostIP, or finds it from an earlier
// run. The API server, PostgreSQL and Kafka bind to HostIP, so it must exist
// before they start (the CNI plugin would only create it with the first pod).
func ensureBridge() error {
	if _, err := net.InterfaceByName(BridgeName); err != nil {
		if out, err := exec.Command("ip", "link", "add", BridgeName, "type", "bridge").CombinedOutput(); err != nil {
			return fmt.Errorf("ip link add %s type bridge: %w: %s", BridgeName, err, out)
		}
	}
	ones, _ := mustCIDR(PodCIDR).Mask.Size()
	addr := fmt.Sprintf("%s/%d", HostIP, ones)
	out, err := exec.Command("ip", "-o", "addr", "show", "dev", BridgeName).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip addr show dev %s: %w: %s", BridgeName, err, out)
	}
	if !bytes.Contains(out, []byte(" "+addr+" ")) {
		if out, err := exec.Command("ip", "addr", "add", addr, "dev", BridgeName).CombinedOutput(); err != nil {
			return fmt.Errorf("ip addr add %s dev %s: %w: %s", addr, BridgeName, err, out)
		}
	}
	if out, err := exec.Command("ip", "link", "set", BridgeName, "up").CombinedOutput(); err != nil {
		return fmt.Errorf("ip link set %s up: %w: %s", BridgeName, err, out)
	}
	return nil
}

// removeBridge deletes the bridge (the pods' veths went with their network
// namespaces).
func removeBridge() error {
	if _, err := net.InterfaceByName(BridgeName); err != nil {
		return nil
	}
	if out, err := exec.Command("ip", "link", "del", BridgeName).CombinedOutput(); err != nil {
		return fmt.Errorf("ip link del %s: %w: %s", BridgeName, err, out)
	}
	return nil
}

func mustCIDR(s string) *net.IPNet {
	_, n, err := net.ParseCIDR(s)
	if err != nil {
		panic(err)
	}
	return n
}

// writeCNIConfig writes the bridge network's configuration for containerd:
// the bridge plugin on BridgeName with HostIP as the pods' gateway, and
// host-local addresses kept under dir (not /var/lib/cni).
func writeCNIConfig(confDir, ipamDir string) error {
	if err := os.MkdirAll(confDir, 0o755); err != nil {
		return err
	}
	conf := fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "outbox",
  "plugins": [
    {
      "type": "bridge",
      "bridge": %q,
      "isGateway": true,
      "isDefaultGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": %q, "gateway": %q}]],
        "dataDir": %q
      }
    }
  ]
}
`, BridgeName, PodCIDR, HostIP, ipamDir)
	return os.WriteFile(filepath.Join(confDir, "10-outbox.conflist"), []byte(conf), 0o644)
}
