// Takes part in an election with Apache Curator's LeaderLatch, for fencelock's interop
// test, driven by one command per line on stdin; every answer is one line on stdout.
//
//   start  → a new LeaderLatch (participant id ID) on the path is started: "STARTED <node>"
//   await  → waits up to 30 s for leadership: "LEADER <czxid of our node>" or "NOT-LEADER"
//   leader → what Curator sees: "SEES <getLeader().getId()> <getLeader().isLeader()> <hasLeadership()>"
//   close  → closes the latch (resigns): "CLOSED"
//   quit   → closes the client and exits: "BYE"
//
// Usage: CuratorLatch CONNECT_STRING LATCH_PATH ID
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.concurrent.TimeUnit;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.leader.LeaderLatch;
import org.apache.curator.framework.recipes.leader.Participant;
import org.apache.curator.retry.RetryNTimes;
import org.apache.curator.utils.ZKPaths;

public class CuratorLatch {
    public static void main(String[] args) throws Exception {
        String connect = args[0];
        String path = args[1];
        String id = args[2];
        CuratorFramework client =
                CuratorFrameworkFactory.newClient(connect, 10000, 5000, new RetryNTimes(3, 100));
        client.start();
        client.blockUntilConnected();
        System.out.println("READY");
        System.out.flush();
        LeaderLatch latch = null;
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        String line;
        while ((line = in.readLine()) != null) {
            switch (line.trim()) {
                case "start": {
                    latch = new LeaderLatch(client, path, id);
                    latch.start();
                    // The node is created in the background: wait until it exists.
                    String ours = null;
                    for (int i = 0; i < 300 && ours == null; i++) {
                        ours = latch.getOurPath();
                        if (ours == null) {
                            Thread.sleep(10);
                        }
                    }
                    System.out.println("STARTED " + (ours == null ? "-" : ZKPaths.getNodeFromPath(ours)));
                    break;
                }
                case "await": {
                    if (latch.await(30, TimeUnit.SECONDS)) {
                        long czxid = client.checkExists().forPath(latch.getOurPath()).getCzxid();
                        System.out.println("LEADER " + czxid);
                    } else {
                        System.out.println("NOT-LEADER");
                    }
                    break;
                }
                case "leader": {
                    Participant leader = latch.getLeader();
                    System.out.println("SEES " + leader.getId() + " " + leader.isLeader() + " "
                            + latch.hasLeadership());
                    break;
                }
                case "close": {
                    latch.close();
                    System.out.println("CLOSED");
                    break;
                }
                case "quit": {
                    client.close();
                    System.out.println("BYE");
                    System.out.flush();
                    return;
                }
                default:
                    System.out.println("UNKNOWN " + line);
            }
            System.out.flush();
        }
        client.close();
    }
}
